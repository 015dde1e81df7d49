// Which tokens each data-parallel rank trains on at each step.
//
// The rule is fixed (and checked by tools outside this repository), so that
// any mesh sees the same global batch at the same step and loss curves can be
// compared across world sizes and resumed runs:
//   global sample i of step s (i = 0..B-1) is the window of T+1 tokens
//   starting at ((s*B + i) * T) mod (len - T - 1); inputs are its first T
//   tokens, targets its last T;
//   data-parallel rank r of D takes samples [r*B/D, (r+1)*B/D).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hp::train {

struct Batch {
  at::Tensor inputs;   // [B/D, T] int64
  at::Tensor targets;  // [B/D, T] int64, inputs shifted by one token
};

// `tokens` is a 1-D int64 CPU tensor. Throws hp::ArgumentError naming the
// argument, its value and what was expected: step < 0, global_batch < 1,
// seq_len < 1, dp_size < 1, dp_rank outside [0, dp_size), global_batch not
// divisible by dp_size, fewer than seq_len + 2 tokens, tokens not 1-D int64.
Batch batch_for_step(const at::Tensor& tokens, int64_t step, int64_t global_batch,
                     int64_t seq_len, int64_t dp_rank, int64_t dp_size);

}  // namespace hp::train
