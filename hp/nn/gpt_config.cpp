#include "hp/nn/gpt_config.h"

#include <utility>

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

std::vector<ParameterShape> GPTConfig::parameter_shapes() const {
  const int64_t d = n_embd;
  std::vector<ParameterShape> shapes = {{"wte.weight", {vocab_size, d}},
                                        {"wpe.weight", {context, d}}};
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string block = block_prefix(i);
    for (ParameterShape p : std::vector<ParameterShape>{
             {"ln_1.weight", {d}},
             {"ln_1.bias", {d}},
             {"attn.c_attn.weight", {3 * d, d}},
             {"attn.c_attn.bias", {3 * d}},
             {"attn.c_proj.weight", {d, d}},
             {"attn.c_proj.bias", {d}},
             {"ln_2.weight", {d}},
             {"ln_2.bias", {d}},
             {"mlp.c_fc.weight", {4 * d, d}},
             {"mlp.c_fc.bias", {4 * d}},
             {"mlp.c_proj.weight", {d, 4 * d}},
             {"mlp.c_proj.bias", {d}},
         }) {
      p.name = block + p.name;
      shapes.push_back(std::move(p));
    }
  }
  shapes.push_back({"ln_f.weight", {d}});
  shapes.push_back({"ln_f.bias", {d}});
  shapes.push_back({"lm_head.weight", {vocab_size, d}});
  return shapes;
}

std::string GPTConfig::block_prefix(int64_t i) { return "h." + std::to_string(i) + "."; }

}  // namespace hp::nn
