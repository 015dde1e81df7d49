#include "tools/hp_train/batches.h"

#include <ATen/ATen.h>

#include <cstring>

#include "hp/util/error.h"

namespace hp::train {

Batch batch_for_step(const at::Tensor& tokens, int64_t step, int64_t global_batch,
                     int64_t seq_len, int64_t dp_rank, int64_t dp_size) {
  HP_CHECK_ARG(tokens.defined() && tokens.dim() == 1 && tokens.scalar_type() == at::kLong &&
                   tokens.device().is_cpu(),
               "batch_for_step: tokens must be a 1-D int64 CPU tensor but got ",
               tokens.defined() ? cat(tokens.scalar_type(), " of shape ", tokens.sizes(), " on ",
                                      tokens.device())
                                : std::string("an undefined tensor"));
  HP_CHECK_ARG(step >= 0, "batch_for_step: step must be >= 0 but got ", step);
  HP_CHECK_ARG(global_batch >= 1, "batch_for_step: global_batch must be >= 1 but got ",
               global_batch);
  HP_CHECK_ARG(seq_len >= 1, "batch_for_step: seq_len must be >= 1 but got ", seq_len);
  HP_CHECK_ARG(dp_size >= 1, "batch_for_step: dp_size must be >= 1 but got ", dp_size);
  HP_CHECK_ARG(dp_rank >= 0 && dp_rank < dp_size, "batch_for_step: dp_rank must be in [0, ",
               dp_size, ") but got ", dp_rank);
  HP_CHECK_ARG(global_batch % dp_size == 0, "batch_for_step: global_batch ", global_batch,
               " must be divisible by dp_size ", dp_size);
  const int64_t len = tokens.size(0);
  HP_CHECK_ARG(len >= seq_len + 2, "batch_for_step: the corpus must hold at least seq_len + 2 = ",
               seq_len + 2, " tokens but has ", len);

  const at::Tensor data = tokens.contiguous();
  const int64_t* src = data.data_ptr<int64_t>();
  const int64_t local = global_batch / dp_size;
  // (s*B + i)*T mod M, reduced as it goes in 128 bits: exact for any step,
  // however large (a resumed step counter is user input).
  using u128 = unsigned __int128;
  const int64_t m = len - seq_len - 1;
  const u128 step_base = static_cast<u128>(step % m) * static_cast<u128>(global_batch % m) % m;
  at::Tensor inputs = at::empty({local, seq_len}, at::kLong);
  at::Tensor targets = at::empty({local, seq_len}, at::kLong);
  for (int64_t j = 0; j < local; ++j) {
    const int64_t i = dp_rank * local + j;
    const auto start = static_cast<int64_t>((step_base + static_cast<u128>(i)) % m *
                                            static_cast<u128>(seq_len % m) % m);
    std::memcpy(inputs.data_ptr<int64_t>() + j * seq_len, src + start, seq_len * sizeof(int64_t));
    std::memcpy(targets.data_ptr<int64_t>() + j * seq_len, src + start + 1,
                seq_len * sizeof(int64_t));
  }
  return {inputs, targets};
}

}  // namespace hp::train
