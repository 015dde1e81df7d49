#include "hp/nn/gpt_config.h"

#include "hp/util/error.h"

namespace hp::nn {

void GPTConfig::validate() const {
  HP_CHECK_ARG(vocab_size > 0, "GPTConfig.vocab_size ", vocab_size, " must be positive");
  HP_CHECK_ARG(context > 0, "GPTConfig.context ", context, " must be positive");
  // At least one layer: the residual projections are scaled by 1/sqrt(2 * n_layer).
  HP_CHECK_ARG(n_layer > 0, "GPTConfig.n_layer ", n_layer, " must be positive");
  HP_CHECK_ARG(n_head > 0, "GPTConfig.n_head ", n_head, " must be positive");
  HP_CHECK_ARG(n_embd > 0, "GPTConfig.n_embd ", n_embd, " must be positive");
  HP_CHECK_ARG(n_embd % n_head == 0, "GPTConfig.n_embd ", n_embd, " must be divisible by n_head ",
               n_head);
  HP_CHECK_ARG(dropout >= 0.0 && dropout < 1.0, "GPTConfig.dropout ", dropout,
               " must be in [0, 1)");
}

}  // namespace hp::nn
