// Rotary position embedding (RoPE), in Hugging Face Llama's "rotate_half"
// convention (N5 in docs/features.md): feature i of a head is paired with
// feature i + head_dim / 2, and the pair at position t is turned by the
// angle t * theta^(-2i / head_dim).
//
// The tables are computed per call from the sequence length (no state, so
// a model's state_dict holds parameters only), in float64 and rounded to
// the requested dtype once. (Hugging Face computes the angles in float32;
// the tables then differ from its by float32 rounding of the angle.)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <utility>

namespace hp::nn {

// {cos, sin}, each [T, head_dim] with `options` (dtype and device):
// cos[t, j] = cos(t * theta^(-2 (j mod head_dim/2) / head_dim)), sin alike.
// Throws hp::ArgumentError unless T >= 1, head_dim is even and positive and
// theta > 1.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t T, int64_t head_dim, double theta,
                                                const c10::TensorOptions& options);

// x [..., T, head_dim] -> x * cos + rotate_half(x) * sin, where
// rotate_half(x) = cat(-x[..., head_dim/2:], x[..., :head_dim/2]).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace hp::nn
