// Rounding bounds for comparing two computations of a GPT that perform the
// same operations in another order (another process's kernels, tensor
// parallelism's split sums), measured on the model in float64.
//
// Every compared value is a composition of elementwise functions
// and sums (dot products in the linear layers and attention, LayerNorm's
// mean and variance, softmax, the loss's mean, and in the backward pass the
// weight gradients' sums over the B*T tokens) of at most n_max terms, with
// n_max = max(4 d, B*T, vocab). Two orders of one sum of n terms differ by
// at most 4 n u Σ|terms| (reordered_sum_bound), the same as scaling every
// term by its own factor within 1 ± 4 n u; an elementwise function (exp,
// erf, rsqrt) rounds by a few u, well inside that. To first order in u, an
// output then moves by its response to relative changes of size 4 n_max u
// in the terms of its sums. Each such term carries a parameter factor or
// is built from parameters through the earlier layers, so we measure that
// response: scale every parameter elementwise by 1 ± kProbe with random
// signs (kProbeDraws draws), rerun forward and backward in float64, and take
// S = max |change| / kProbe over the draws and over each compared tensor.
// kProbe = 2^-30 is small enough that second-order terms (~kProbe^2 ≈ 1e-18
// relative) and float64 rounding (~1e-16 relative) do not show in the
// change, and large enough that it dominates both. The bound on a tensor is
// then 4 n_max u S. This is a measurement, not a proof: random signs probe
// typical directions, not the worst alignment of rounding errors; the
// worst-case factor 4 n_max (n_max = 128 here, where real rounding grows
// like √n) is the margin for that, and HP_TEST_PRINT_BOUND_USE=1 prints how
// much of it the comparison uses.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "hp/nn/gpt.h"

namespace hp::nn {

constexpr double kProbe = 0x1p-30;
constexpr int kProbeDraws = 8;

// The logits, the loss and every parameter's gradient ("grad." + name) of
// one forward and backward pass.
using Named = std::map<std::string, at::Tensor>;
Named forward_backward(GPT& model, const at::Tensor& idx, const at::Tensor& targets);

// A model of `config` in `dtype` holding `source`'s parameters.
GPT copy_of(GPT& source, const GPTConfig& config, at::ScalarType dtype);

// The float64 results at `model`'s parameters and, for each of them, S:
// the largest change per unit of relative parameter perturbation.
struct Sensitivity {
  Named base;
  std::map<std::string, double> per_unit;
};
Sensitivity measure_sensitivity(GPT& model, const GPTConfig& config, const at::Tensor& idx,
                                const at::Tensor& targets);

}  // namespace hp::nn
