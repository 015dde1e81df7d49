// The tensor-parallel tests' model: a two-layer ReLU MLP (fc1 column
// parallel, fc2 row parallel in the usual plan) and the bounds within which
// a tensor-parallel run of it must match the single process.
//
// Where the runs can differ: each output element of fc1 is the same sum of
// d + 1 terms in both, but a BLAS may order it differently for a narrower
// matrix; each output element of fc2 is a sum of h + 1 terms that the
// tensor-parallel run splits into per-rank partial sums and adds with an
// all-reduce. Both are reordered sums (reordered_sum_bound). ReLU is exact
// and 1-Lipschitz, so it passes a difference on unchanged, except that an
// element within its bound of 0 may take the other branch in backward,
// where the bound allows the whole gradient. Every later difference is the
// first-order propagation of these through the remaining linear maps, plus
// their own reordered sums; MSE's gradient 2 (out - y) / N rounds three
// times in each run.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

#include "hp/nn/module.h"
#include "tests/support/rounding_bounds.h"

namespace hp::test {

struct TpMlpImpl : nn::Module {
  TpMlpImpl(int64_t d, int64_t h) : nn::Module("TpMlp") {
    fc1 = register_module("fc1", torch::nn::Linear(d, h));
    fc2 = register_module("fc2", torch::nn::Linear(h, d));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
HP_MODULE(TpMlp);

// d 6, h 10: h splits unevenly over 3 and 4 ranks (4/4/2, 3/3/3/1).
inline TpMlp make_tp_mlp(uint64_t seed = 7) {
  torch::manual_seed(seed);
  return TpMlp(6, 10);
}

struct MlpBounds {
  at::Tensor out;                          // [B, d]
  double loss = 0;                         // of the MSE loss
  std::map<std::string, at::Tensor> grad;  // by parameter name
};

// The bounds for a tensor-parallel run of `ref`'s parameters on (x, y),
// in Double; see above.
inline MlpBounds mlp_bounds(TpMlp& ref, const at::Tensor& x, const at::Tensor& y) {
  at::NoGradGuard no_grad;
  const double u = unit_roundoff(at::kFloat);
  auto dbl = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  auto reordered = [](const at::Tensor& sum_abs, int64_t n) {
    return reordered_sum_bound(sum_abs, n, at::kFloat);
  };
  const at::Tensor W1 = dbl(ref->fc1->weight).abs(), b1 = dbl(ref->fc1->bias).abs();
  const at::Tensor W2s = dbl(ref->fc2->weight), W2 = W2s.abs(), b2 = dbl(ref->fc2->bias).abs();
  const at::Tensor X = dbl(x).abs();
  // The reference's own values (float, as it computes them).
  const at::Tensor z1f = ref->fc1(x);
  const at::Tensor af = torch::relu(z1f);
  const at::Tensor z1 = dbl(z1f), a = dbl(af), out = dbl(ref->fc2(af));
  const int64_t B = x.size(0), d = x.size(1), h = W1.size(0), N = B * d;

  MlpBounds b;
  const at::Tensor e_z1 = reordered(X.mm(W1.t()) + b1, d + 1);
  const at::Tensor e_a = e_z1;
  b.out = e_a.mm(W2.t()) + reordered(a.abs().mm(W2.t()) + b2, h + 1);
  const at::Tensor diff = out - dbl(y);
  const double loss = (diff * diff).sum().item<double>() / double(N);
  b.loss = (2.0 * diff.abs() * b.out).sum().item<double>() / double(N) +
           reordered_sum_bound(loss, N, at::kFloat) + 2 * u * loss;

  const at::Tensor g_out = 2.0 * diff / double(N);
  const at::Tensor e_g_out = 2.0 * b.out / double(N) + 6 * u * g_out.abs();
  const at::Tensor g_a = g_out.mm(W2s);
  const at::Tensor e_g_a = e_g_out.mm(W2) + reordered(g_out.abs().mm(W2), d);
  const at::Tensor g_z1 = g_a * (z1 > 0).to(at::kDouble);
  const at::Tensor e_g_z1 = at::where(z1.abs() <= e_z1, g_a.abs() + e_g_a, e_g_a);
  b.grad["fc2.weight"] = e_g_out.t().mm(a.abs()) + g_out.abs().t().mm(e_a) +
                         reordered(g_out.abs().t().mm(a.abs()), B);
  b.grad["fc2.bias"] = e_g_out.sum(0) + reordered(g_out.abs().sum(0), B);
  b.grad["fc1.weight"] = e_g_z1.t().mm(X) + reordered(g_z1.abs().t().mm(X), B);
  b.grad["fc1.bias"] = e_g_z1.sum(0) + reordered(g_z1.abs().sum(0), B);
  return b;
}

}  // namespace hp::test
