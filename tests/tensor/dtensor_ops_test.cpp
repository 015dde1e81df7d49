// Sharding rules of tensor-form DTensors (docs/design.md, "DTensor op
// dispatch") against the single-process result computed in the same test.
//
// The binary runs on 1, 2, 3 and 4 ranks (tests/tensor/CMakeLists.txt). The
// sizes (7, 5, 10, 11) are not divisible by 3 or 4, so shards are uneven
// and on 4 ranks some are empty. Every result is checked three ways: its
// placements (layout_of), its global shape, and its global value
// (full_tensor) against the same ops on plain tensors; gradients of
// DTensor leaves likewise, in the leaf's own layout.
//
// Tolerances. Everything runs in float64 (u = 2^-53), and each bound comes
// from what the two computations can do differently:
//  - the same IEEE operations on the same operands (copies, views, +, -, *,
//    / elementwise, per-row kernels such as layer norm over batch-sharded
//    rows) give the same bits: bound 0;
//  - a sum may add its terms in another order (local partial sums and then
//    an all-reduce, other BLAS blocking): two orders of n terms differ by at
//    most reordered_sum_bound(Σ|terms|, n) = 4 n u Σ|terms|; a matrix
//    product is such a sum with Σ|terms| = |A| @ |B| and n = k (a bias is
//    one more term);
//  - exp, log, erf, tanh (and pow) run either vectorized (Sleef's u10
//    functions, within 1 ulp) or scalar (glibc, within 2 ulp in its
//    published worst cases), depending on where an element falls in its
//    shard versus in the whole tensor, so two evaluations differ by at most
//    3 ulp <= 3 * 2^-52 |result| = 6 u |result| (kFn);
// and errors of earlier steps are carried forward to first order, as each
// test says.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

namespace F = torch::nn::functional;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr double kU = 0x1p-53;  // unit roundoff of float64
// Two evaluations of one transcendental function differ by at most kFn
// times the result (3 ulp; see the top of the file).
constexpr double kFn = 6 * kU;

// The 1-D mesh over every rank, and (on 4 ranks) the 2 x 2 one. Made once:
// every rank runs the tests in the same order, so they meet here.
DeviceMeshPtr line() {
  static DeviceMeshPtr mesh = init_device_mesh("cpu", {test::world_size()}, {"tp"});
  return mesh;
}
DeviceMeshPtr grid() {
  static DeviceMeshPtr mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  return mesh;
}
int64_t ranks() { return line()->size(0); }

Layout on_line(const Placements& placements) { return Layout(line(), placements); }

// Values in [-1, 1), the same on every rank.
at::Tensor data(at::IntArrayRef shape, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::rand(shape, gen, at::TensorOptions().dtype(at::kDouble)) * 2 - 1;
}

// A DTensor leaf of `full` laid out as `layout`, and its reference twin.
at::Tensor dleaf(const at::Tensor& full, const Layout& layout) {
  return distribute(full.clone().requires_grad_(), layout);
}
at::Tensor dleaf(const at::Tensor& full, const Placements& placements) {
  return dleaf(full, on_line(placements));
}
at::Tensor rleaf(const at::Tensor& full) { return full.clone().requires_grad_(); }

at::Tensor exact() { return at::zeros({}, at::kDouble); }

at::Tensor sum_bound(const at::Tensor& sum_abs_terms, int64_t n) {
  return test::reordered_sum_bound(sum_abs_terms, n, at::kDouble);
}
// A @ B (broadcasting like matmul) in another order.
at::Tensor mm_bound(const at::Tensor& a, const at::Tensor& b) {
  return sum_bound(a.abs().matmul(b.abs()), a.size(-1));
}

// `actual` is a DTensor with `placements`, the global shape of `expected`,
// and a global value within `bound` of it. Collective (full_tensor).
testing::AssertionResult holds(const at::Tensor& actual, const Placements& placements,
                               const at::Tensor& expected, const at::Tensor& bound) {
  if (!actual.defined()) return testing::AssertionFailure() << "undefined tensor";
  if (!is_dtensor(actual)) {
    return testing::AssertionFailure() << "a plain tensor, not a DTensor";
  }
  const at::Tensor full = full_tensor(actual);
  if (layout_of(actual).placements() != placements) {
    return testing::AssertionFailure()
           << "layout " << layout_of(actual).str() << ", expected " << to_string(placements);
  }
  if (actual.sizes() != expected.sizes() || full.sizes() != expected.sizes()) {
    return testing::AssertionFailure() << "global shape " << actual.sizes() << " (gathered "
                                       << full.sizes() << "), expected " << expected.sizes();
  }
  const Layout& layout = layout_of(actual);
  const std::vector<int64_t> local = local_shape(
      expected.sizes().vec(), layout.spec(), layout.mesh()->shape(), layout.mesh()->coordinate());
  if (local_of(actual).sizes().vec() != local) {
    return testing::AssertionFailure()
           << "local shape " << local_of(actual).sizes() << ", expected " << to_string(local);
  }
  return test::within_bound(full, expected, bound);
}

Placements no_partial(Placements placements) {
  for (auto& p : placements) {
    if (p.is_partial()) p = Replicate();
  }
  return placements;
}

// Σ out ⊙ c with c laid out as `out` (Partial dims as Replicate): the
// gradient reaching `out` is then c in out's own sharding, so backward rules
// see sharded gradients (a plain c would make every gradient Replicate).
at::Tensor readout(const at::Tensor& out, const at::Tensor& c) {
  const Layout& layout = layout_of(out);
  return (out * distribute(c, Layout(layout.mesh(), no_partial(layout.placements())))).sum();
}

// ---- matrix products -----------------------------------------------------------

// Inputs of 3 dims (linear folds them into a matrix, or multiplies and
// adds the bias in place) and of 2 (addmm with the bias inside).
const std::vector<std::vector<int64_t>> kBatchShapes = {{7, 3}, {7}};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
std::vector<int64_t> with(std::vector<int64_t> shape, int64_t last) {
  shape.push_back(last);
  return shape;
}
std::vector<int64_t> batch_dims(const std::vector<int64_t>& batch) {
  std::vector<int64_t> dims(batch.size());
  for (size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<int64_t>(i);
  return dims;
}

// Column parallel: the weight split by output features gives S(-1).
TEST(DTensorOps, ColumnParallelLinearShardsOutputFeatures) {
  const int64_t D = 5, H = 10;
  const at::Tensor w = data({H, D}, 2), b = data({H}, 3);
  for (const auto& batch : kBatchShapes) {
    SCOPED_TRACE("input " + to_string(with(batch, D)));
    const int64_t rows = numel_of(batch), nd = static_cast<int64_t>(batch.size()) + 1;
    const at::Tensor x = data(with(batch, D), 1), c = data(with(batch, H), 4);
    at::Tensor X = dleaf(x, {Replicate()}), W = dleaf(w, {Shard(0)}), Bias = dleaf(b, {Shard(0)});
    at::Tensor rx = rleaf(x), rw = rleaf(w), rb = rleaf(b);
    at::Tensor y = F::linear(X, W, Bias);
    at::Tensor ry = F::linear(rx, rw, rb);
    // One product of exact operands plus the bias: D + 1 terms.
    const at::Tensor y_bound = sum_bound(x.abs().matmul(w.abs().t()) + b.abs(), D + 1);
    EXPECT_TRUE(holds(y, {Shard(nd - 1)}, ry, y_bound));

    at::Tensor loss = readout(y, c), rloss = (ry * c).sum();
    // Σ y ⊙ c over rows H terms, each y within y_bound.
    EXPECT_TRUE(holds(loss, {Partial()}, rloss,
                      sum_bound((ry * c).abs().sum(), rows * H) + (c.abs() * y_bound).sum()));
    loss.backward();
    rloss.backward();
    // The gradient of y is c exactly, so each gradient is one sum of exact
    // terms.
    const at::Tensor c2 = c.reshape({rows, H}), x2 = x.reshape({rows, D});
    EXPECT_TRUE(holds(W.grad(), {Shard(0)}, rw.grad(), mm_bound(c2.t(), x2)));
    EXPECT_TRUE(
        holds(Bias.grad(), {Shard(0)}, rb.grad(), sum_bound(c.abs().sum(batch_dims(batch)), rows)));
    EXPECT_TRUE(holds(X.grad(), {Replicate()}, rx.grad(), mm_bound(c, w)));
  }
}

// Row parallel: input features split on both sides give a Partial output;
// the Replicate bias is added once.
TEST(DTensorOps, RowParallelLinearGivesPartial) {
  const int64_t D = 5, H = 10;
  const at::Tensor w = data({D, H}, 6), b = data({D}, 7);
  for (const auto& batch : kBatchShapes) {
    SCOPED_TRACE("input " + to_string(with(batch, H)));
    const int64_t rows = numel_of(batch), nd = static_cast<int64_t>(batch.size()) + 1;
    const at::Tensor x = data(with(batch, H), 5), c = data(with(batch, D), 8);
    at::Tensor X = dleaf(x, {Shard(nd - 1)}), W = dleaf(w, {Shard(1)}),
               Bias = dleaf(b, {Replicate()});
    at::Tensor rx = rleaf(x), rw = rleaf(w), rb = rleaf(b);
    at::Tensor y = F::linear(X, W, Bias);
    at::Tensor ry = F::linear(rx, rw, rb);
    EXPECT_TRUE(holds(y, {Partial()}, ry, sum_bound(x.abs().matmul(w.abs().t()) + b.abs(), H + 1)));
    readout(y, c).backward();
    (ry * c).sum().backward();
    const at::Tensor c2 = c.reshape({rows, D}), x2 = x.reshape({rows, H});
    EXPECT_TRUE(holds(W.grad(), {Shard(1)}, rw.grad(), mm_bound(c2.t(), x2)));
    EXPECT_TRUE(holds(Bias.grad(), {Replicate()}, rb.grad(),
                      sum_bound(c.abs().sum(batch_dims(batch)), rows)));
    EXPECT_TRUE(holds(X.grad(), {Shard(nd - 1)}, rx.grad(), mm_bound(c, w)));
  }
}

struct ProductCase {
  Placements a, b, out;
};

std::string describe(const ProductCase& k) {
  return to_string(k.a) + " @ " + to_string(k.b) + " -> " + to_string(k.out);
}

// mm: (S(0), R) -> S(0), (R, S(1)) -> S(1), contracted dim split -> Partial;
// mismatched operands are redistributed to the nearest of those, keeping
// whichever operand is sharded.
TEST(DTensorOps, MatrixProductPlacements) {
  const int64_t M = 7, K = 10, N = 5;
  const at::Tensor a = data({M, K}, 11), b = data({K, N}, 12), c = data({M, N}, 13);
  at::Tensor ra = rleaf(a), rb = rleaf(b);
  at::Tensor rout = ra.mm(rb);
  (rout * c).sum().backward();
  const std::vector<ProductCase> cases = {
      {{Replicate()}, {Replicate()}, {Replicate()}}, {{Shard(0)}, {Replicate()}, {Shard(0)}},
      {{Replicate()}, {Shard(1)}, {Shard(1)}},       {{Shard(1)}, {Shard(0)}, {Partial()}},
      {{Shard(1)}, {Replicate()}, {Partial()}},      {{Replicate()}, {Shard(0)}, {Partial()}},
      {{Shard(0)}, {Shard(1)}, {Shard(0)}},          {{Shard(0)}, {Shard(0)}, {Shard(0)}},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(describe(k));
    at::Tensor A = dleaf(a, k.a), B = dleaf(b, k.b);
    at::Tensor out = A.mm(B);
    EXPECT_TRUE(holds(out, k.out, rout, mm_bound(a, b)));
    readout(out, c).backward();
    EXPECT_TRUE(holds(A.grad(), k.a, ra.grad(), mm_bound(c, b.t())));
    EXPECT_TRUE(holds(B.grad(), k.b, rb.grad(), mm_bound(a.t(), c)));
  }
}

// bmm keeps a shared batch shard; matmul of a 3-D by a 2-D tensor folds the
// batch into rows and keeps the contracted split as Partial.
TEST(DTensorOps, BatchedProductPlacements) {
  const int64_t Z = 3, M = 7, K = 10, N = 5;
  const at::Tensor a = data({Z, M, K}, 14), b = data({Z, K, N}, 15), c = data({Z, M, N}, 16);
  at::Tensor ra = rleaf(a), rb = rleaf(b);
  at::Tensor rout = ra.bmm(rb);
  (rout * c).sum().backward();
  const std::vector<ProductCase> cases = {
      {{Shard(0)}, {Shard(0)}, {Shard(0)}},
      {{Shard(1)}, {Replicate()}, {Shard(1)}},
      {{Replicate()}, {Shard(2)}, {Shard(2)}},
      {{Shard(2)}, {Shard(1)}, {Partial()}},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(describe(k));
    at::Tensor A = dleaf(a, k.a), B = dleaf(b, k.b);
    at::Tensor out = A.bmm(B);
    EXPECT_TRUE(holds(out, k.out, rout, mm_bound(a, b)));
    readout(out, c).backward();
    EXPECT_TRUE(holds(A.grad(), k.a, ra.grad(), mm_bound(c, b.transpose(1, 2))));
    EXPECT_TRUE(holds(B.grad(), k.b, rb.grad(), mm_bound(a.transpose(1, 2), c)));
  }

  const at::Tensor w = data({K, N}, 17);
  at::Tensor A = dleaf(a, {Shard(2)}), W = dleaf(w, {Shard(0)});
  at::Tensor rA = rleaf(a), rW = rleaf(w);
  at::Tensor out = A.matmul(W), rmm = rA.matmul(rW);
  EXPECT_TRUE(holds(out, {Partial()}, rmm, mm_bound(a, w)));
  readout(out, c).backward();
  (rmm * c).sum().backward();
  EXPECT_TRUE(holds(A.grad(), {Shard(2)}, rA.grad(), mm_bound(c, w.t())));
  EXPECT_TRUE(holds(W.grad(), {Shard(0)}, rW.grad(),
                    mm_bound(a.reshape({Z * M, K}).t(), c.reshape({Z * M, N}))));
}

// ---- embedding -------------------------------------------------------------------

// A row-sharded (vocabulary-parallel) table gives a Partial lookup, a
// column-sharded one S(-1); sharded ids with a Replicate table keep their
// shard. The table's gradient arrives in the table's layout.
TEST(DTensorOps, EmbeddingPlacements) {
  const int64_t V = 11, D = 4, B = 7, T = 3;
  const at::Tensor table = data({V, D}, 21), c = data({B, T, D}, 22);
  // Every id from 0 to V - 1 occurs, most more than once.
  const at::Tensor ids = at::arange(B * T, at::kLong).remainder(V).reshape({B, T});
  at::Tensor rt = rleaf(table);
  at::Tensor rout = F::embedding(ids, rt);
  (rout * c).sum().backward();
  // The table's gradient sums c's rows by id: at most B T terms per row.
  const at::Tensor grad_bound = sum_bound(
      at::zeros({V, D}, at::kDouble).index_add(0, ids.reshape(-1), c.abs().reshape({-1, D})),
      B * T);
  struct Case {
    Placements table, ids, out;
    bool dtensor_ids;
  };
  const std::vector<Case> cases = {
      {{Shard(0)}, {Replicate()}, {Partial()}, false},
      {{Shard(1)}, {Replicate()}, {Shard(2)}, false},
      {{Replicate()}, {Shard(0)}, {Shard(0)}, true},
      {{Shard(0)}, {Shard(0)}, {Partial()}, true},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(to_string(k.table) + " table, ids " +
                 (k.dtensor_ids ? to_string(k.ids) : std::string("plain")));
    at::Tensor Table = dleaf(table, k.table);
    at::Tensor Ids = k.dtensor_ids ? distribute(ids, on_line(k.ids)) : ids;
    at::Tensor out = F::embedding(Ids, Table);
    // A lookup copies rows; the Partial one adds zeros to them.
    EXPECT_TRUE(holds(out, k.out, rout, exact()));
    readout(out, c).backward();
    EXPECT_TRUE(holds(Table.grad(), k.table, rt.grad(), grad_bound));
  }
}

// ---- reductions --------------------------------------------------------------------

// Summing over a sharded dim gives Partial; over another dim the shard
// stays. A mean divides by the global count, also for uneven shards.
TEST(DTensorOps, SumAndMeanPlacements) {
  const int64_t B = 7, H = 10;
  const at::Tensor x = data({B, H}, 31);
  struct Case {
    std::string name;
    Placements in, out;
    std::function<at::Tensor(const at::Tensor&)> op;
    at::Tensor bound;  // of the result
  };
  const at::Tensor by_row = sum_bound(x.abs().sum(1), H), by_col = sum_bound(x.abs().sum(0), B),
                   all = sum_bound(x.abs().sum(), B * H);
  const std::vector<Case> cases = {
      {"sum(1) of S(1)",
       {Shard(1)},
       {Partial()},
       [](const at::Tensor& t) { return t.sum(1); },
       by_row},
      {"sum(0) of S(1)",
       {Shard(1)},
       {Shard(0)},
       [](const at::Tensor& t) { return t.sum(0); },
       by_col},
      {"sum() of S(1)", {Shard(1)}, {Partial()}, [](const at::Tensor& t) { return t.sum(); }, all},
      {"sum({0, 1}, keepdim) of S(0)",
       {Shard(0)},
       {Partial()},
       [](const at::Tensor& t) {
         return t.sum(at::IntArrayRef{0, 1}, true);
       },
       all},
      {"sum(0) of S(0)",
       {Shard(0)},
       {Partial()},
       [](const at::Tensor& t) { return t.sum(0); },
       by_col},
      {"mean(1) of S(1)",
       {Shard(1)},
       {Partial()},
       [](const at::Tensor& t) { return t.mean(1); },
       by_row / H},
      {"mean(0, keepdim) of S(1)",
       {Shard(1)},
       {Shard(1)},
       [](const at::Tensor& t) { return t.mean(0, true); },
       by_col / B},
      {"mean() of S(0)",
       {Shard(0)},
       {Partial()},
       [](const at::Tensor& t) { return t.mean(); },
       all / (B * H)},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    at::Tensor X = dleaf(x, k.in), rx = rleaf(x);
    at::Tensor out = k.op(X), rout = k.op(rx);
    EXPECT_TRUE(holds(out, k.out, rout, k.bound));
    const at::Tensor c = data(rout.sizes(), 32);
    readout(out, c).backward();
    (rout * c).sum().backward();
    // The gradient is c expanded (and divided by the count): exact.
    EXPECT_TRUE(holds(X.grad(), k.in, rx.grad(), exact()));
  }

  // Sums of a Partial tensor stay Partial.
  const at::Tensor a = data({B, H}, 33), b = data({H, H}, 34);
  at::Tensor P = distribute(a, on_line({Shard(1)})).mm(distribute(b, on_line({Shard(0)})));
  EXPECT_TRUE(
      holds(P.sum(0), {Partial()}, a.mm(b).sum(0), sum_bound(a.abs().mm(b.abs()).sum(0), H * B)));
}

// A norm over a sharded tensor is Replicate; sum of squares over every
// shard, then a square root: the sums differ by reordering (n = numel terms
// of x^2, each the same rounded square), which the root halves to first
// order, and the roots may differ by kFn (pow vs sqrt paths).
TEST(DTensorOps, NormOfShardedTensorIsReplicate) {
  const at::Tensor x = data({7, 10}, 35);
  const at::Tensor ref = x.norm();
  const double s = x.pow(2).sum().item<double>();
  const double bound = test::reordered_sum_bound(s, x.numel(), at::kDouble) / std::sqrt(s) +
                       kFn * ref.item<double>();
  for (const Placements& p :
       {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Replicate()}}) {
    SCOPED_TRACE(to_string(p));
    at::Tensor n = distribute(x, on_line(p)).norm();
    EXPECT_TRUE(holds(n, {Replicate()}, ref, at::full({}, bound, at::kDouble)));
  }
}

// ---- softmax and the loss --------------------------------------------------------

// Bounds of softmax over a row of n: each exp differs by kFn, the exp-sum
// by reordering (4 n u) and by its terms (kFn), and each side rounds the
// final division or multiplication by a reciprocal (2u each side):
// |Δp| <= ((4n + 4) u + 2 kFn) p.
at::Tensor softmax_bound(const at::Tensor& p, int64_t n) {
  return ((4.0 * n + 4) * kU + 2 * kFn) * p;
}

// log_softmax y = x - max - log S: log S moves by |ΔS| / S <= 4 n u + kFn
// plus log's own kFn |log S|; the two subtractions round by u each on each
// side, at most |x - max| + |log S| in size; and |log S| <= |x - max| + |y|.
// Hence |Δy| <= 4 n u + kFn + (kFn + 8u) (|x - max| + |y|) + 4 u |x|, the
// last for kernels that form max + log S first.
at::Tensor log_softmax_bound(const at::Tensor& x, const at::Tensor& y, int64_t dim) {
  const int64_t n = x.size(dim);
  const at::Tensor shifted = (x - std::get<0>(x.max(dim, true))).abs();
  return (4.0 * n * kU + kFn) + (kFn + 8 * kU) * (shifted + y.abs()) + 4 * kU * x.abs();
}

// Backward of softmax, gx = p (g - s) with s = Σ g p along `dim`, from
// exact g and p within p_bound: first order in p's error, plus s's
// reordering and the two roundings on each side.
at::Tensor softmax_grad_bound(const at::Tensor& p, const at::Tensor& p_bound, const at::Tensor& g,
                              int64_t dim) {
  const int64_t n = p.size(dim);
  const at::Tensor s = (g * p).sum(dim, true);
  const at::Tensor ds =
      (g.abs() * p_bound).sum(dim, true) + sum_bound((g * p).abs().sum(dim, true), n);
  return p_bound * (g - s).abs() + p * ds + 4 * kU * (p * (g - s)).abs() + 4 * kU * p * s.abs();
}

// Backward of log_softmax, gx = g - exp(y) Σg: exp(y) moves by its own kFn
// and by y's error (exp(y) |Δy|, first order), Σg by reordering; two
// roundings on each side.
at::Tensor log_softmax_grad_bound(const at::Tensor& y, const at::Tensor& y_bound,
                                  const at::Tensor& g, int64_t dim) {
  const int64_t n = y.size(dim);
  const at::Tensor p = y.exp(), sg = g.sum(dim, true);
  return p * (y_bound + kFn) * sg.abs() + p * sum_bound(g.abs().sum(dim, true), n) +
         4 * kU * (g.abs() + (p * sg).abs());
}

// softmax / log_softmax over a sharded dim stay sharded (the max and the
// exp-sum are reduced across shards), over another dim trivially so.
TEST(DTensorOps, SoftmaxOverShardedDimStaysSharded) {
  // 5 columns on 4 ranks leave one shard empty (2, 2, 1, 0).
  for (int64_t V : {11, 5}) {
    SCOPED_TRACE("width " + std::to_string(V));
    const int64_t B = 7;
    const at::Tensor x = data({B, V}, 41) * 4, c = data({B, V}, 42);
    for (int64_t dim : {1, 0}) {
      SCOPED_TRACE("dim " + std::to_string(dim));
      for (bool log : {false, true}) {
        SCOPED_TRACE(log ? "log_softmax" : "softmax");
        at::Tensor X = dleaf(x, {Shard(1)}), rx = rleaf(x);
        at::Tensor y = log ? X.log_softmax(dim) : X.softmax(dim);
        at::Tensor ry = log ? rx.log_softmax(dim) : rx.softmax(dim);
        const at::Tensor rd = ry.detach();
        const at::Tensor y_bound =
            log ? log_softmax_bound(x, rd, dim) : softmax_bound(rd, x.size(dim));
        EXPECT_TRUE(holds(y, {Shard(1)}, ry, y_bound));
        readout(y, c).backward();
        (ry * c).sum().backward();
        const at::Tensor g_bound = log ? log_softmax_grad_bound(rd, y_bound, c, dim)
                                       : softmax_grad_bound(rd, y_bound, c, dim);
        EXPECT_TRUE(holds(X.grad(), {Shard(1)}, rx.grad(), g_bound));
      }
    }
  }
}

// The NLL loss of class-sharded log-probabilities is computed without
// gathering them (loss parallel): Partial, with a class-sharded gradient.
// Batch-sharded log-probabilities work the same way.
TEST(DTensorOps, NllLossOverShardedLogProbs) {
  const int64_t B = 7, V = 11;
  const at::Tensor x = data({B, V}, 43) * 4;
  at::Tensor target = at::tensor({0, 10, 3, 7, -100, 5, 10}, at::kLong);
  const at::Tensor valid = target != -100;
  const at::Tensor picked_index = target.clamp_min(0).unsqueeze(1);
  const int64_t count = valid.sum().item<int64_t>();
  const at::Tensor ry_full = x.log_softmax(1);
  const at::Tensor y_bound = log_softmax_bound(x, ry_full, 1);
  const at::Tensor picked = ry_full.gather(1, picked_index).squeeze(1) * valid;
  const at::Tensor picked_bound = y_bound.gather(1, picked_index).squeeze(1) * valid;

  struct Case {
    std::string name;
    at::Reduction::Reduction reduction;
    Placements logits, out;
  };
  const std::vector<Case> cases = {
      {"mean, classes sharded", at::Reduction::Mean, {Shard(1)}, {Partial()}},
      {"sum, classes sharded", at::Reduction::Sum, {Shard(1)}, {Partial()}},
      {"none, classes sharded", at::Reduction::None, {Shard(1)}, {Partial()}},
      {"mean, rows sharded", at::Reduction::Mean, {Shard(0)}, {Partial()}},
      {"none, rows sharded", at::Reduction::None, {Shard(0)}, {Shard(0)}},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    at::Tensor X = dleaf(x, k.logits), rx = rleaf(x);
    F::NLLLossFuncOptions options;
    if (k.reduction == at::Reduction::Mean) options.reduction(torch::kMean);
    if (k.reduction == at::Reduction::Sum) options.reduction(torch::kSum);
    if (k.reduction == at::Reduction::None) options.reduction(torch::kNone);
    at::Tensor logp = X.log_softmax(1);
    EXPECT_TRUE(holds(logp, k.logits, rx.log_softmax(1), y_bound));
    at::Tensor loss = F::nll_loss(logp, target, options);
    at::Tensor rloss = F::nll_loss(rx.log_softmax(1), target, options);
    // The loss is -Σ picked (over `count` rows, / count for a mean): each
    // picked value within y_bound, the sum reordered.
    at::Tensor loss_bound;
    if (k.reduction == at::Reduction::None) {
      loss_bound = picked_bound;
    } else {
      loss_bound = picked_bound.sum() + sum_bound(picked.abs().sum(), count);
      if (k.reduction == at::Reduction::Mean) loss_bound = loss_bound / count;
    }
    EXPECT_TRUE(holds(loss, k.out, rloss, loss_bound));
    const at::Tensor c =
        k.reduction == at::Reduction::None ? data({B}, 44) : at::ones({}, at::kDouble);
    (k.reduction == at::Reduction::None ? readout(loss, c) : loss).backward();
    (rloss * c).sum().backward();
    // The gradient reaching the log-probabilities is -c_i (/ count) at the
    // targets, the same number on both sides.
    at::Tensor g =
        at::zeros({B, V}, at::kDouble)
            .scatter(1, picked_index, (-c.expand({B}) * valid).unsqueeze(1).to(at::kDouble));
    if (k.reduction == at::Reduction::Mean) g = g / count;
    EXPECT_TRUE(
        holds(X.grad(), k.logits, rx.grad(), log_softmax_grad_bound(ry_full, y_bound, g, 1)));
  }

  // cross_entropy decomposes into the two.
  at::Tensor X = dleaf(x, {Shard(1)}), rx = rleaf(x);
  at::Tensor loss = F::cross_entropy(X, target), rloss = F::cross_entropy(rx, target);
  EXPECT_TRUE(holds(loss, {Partial()}, rloss,
                    (picked_bound.sum() + sum_bound(picked.abs().sum(), count)) / count));

  // 5 classes on 4 ranks: one rank holds none of them.
  const at::Tensor x5 = data({B, 5}, 45) * 4;
  const at::Tensor target5 = at::tensor({0, 4, 3, 2, 1, 4, 4}, at::kLong);
  const at::Tensor y5 = x5.log_softmax(1), y5_bound = log_softmax_bound(x5, y5, 1);
  const at::Tensor index5 = target5.unsqueeze(1);
  at::Tensor X5 = dleaf(x5, {Shard(1)}), rx5 = rleaf(x5);
  at::Tensor loss5 = F::cross_entropy(X5, target5), rloss5 = F::cross_entropy(rx5, target5);
  EXPECT_TRUE(holds(
      loss5, {Partial()}, rloss5,
      (y5_bound.gather(1, index5).sum() + sum_bound(y5.gather(1, index5).abs().sum(), B)) / B));
  loss5.backward();
  rloss5.backward();
  const at::Tensor g5 = at::zeros({B, 5}, at::kDouble).scatter(1, index5, -1.0 / B);
  EXPECT_TRUE(
      holds(X5.grad(), {Shard(1)}, rx5.grad(), log_softmax_grad_bound(y5, y5_bound, g5, 1)));
}

// ---- views -----------------------------------------------------------------------

struct ViewCase {
  std::string name;
  at::IntArrayRef shape;
  Placements in, out;
  std::function<at::Tensor(const at::Tensor&)> op;
};

// Runs each case forward and backward; views copy nothing or copy exactly,
// so values and gradients must match exactly.
void check_views(const std::vector<ViewCase>& cases) {
  uint64_t seed = 100;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name + " of " + to_string(k.in));
    const at::Tensor x = data(k.shape, ++seed), c = data(k.op(x).sizes(), ++seed);
    // One case's error must not hide the others'.
    auto run = [&] {
      at::Tensor X = dleaf(x, k.in), rx = rleaf(x);
      at::Tensor out = k.op(X), rout = k.op(rx);
      EXPECT_TRUE(holds(out, k.out, rout, exact()));
      readout(out, c).backward();
      (rout * c).sum().backward();
      EXPECT_TRUE(holds(X.grad(), k.in, rx.grad(), exact()));
    };
    EXPECT_NO_THROW(run());
  }
}

// A dim that is split or merged keeps its shard when the shard boundaries
// stay whole rows of the result (the outer piece divisible by the number of
// shards), becomes a strided shard when a sharded inner dim divisible by the
// number of shards merges with outer ones (each rank holds its piece of
// every block), and is gathered otherwise.
TEST(DTensorOps, ViewsKeepDivisibleShardsAndGatherOthers) {
  const int64_t n = ranks();
  auto kept_if = [](bool divisible, Placement p) { return divisible ? p : Replicate(); };
  check_views({
      {"view [7, 12] -> [7, 4, 3]",
       {7, 12},
       {Shard(1)},
       {kept_if(4 % n == 0, Shard(1))},
       [](const at::Tensor& t) {
         return t.view({7, 4, 3});
       }},
      {"view [7, 12] -> [7, 6, 2]",
       {7, 12},
       {Shard(1)},
       {kept_if(6 % n == 0, Shard(1))},
       [](const at::Tensor& t) {
         return t.view({7, 6, 2});
       }},
      {"view [7, 4, 3] -> [7, 12]",
       {7, 4, 3},
       {Shard(1)},
       {kept_if(4 % n == 0, Shard(1))},
       [](const at::Tensor& t) {
         return t.view({7, 12});
       }},
      {"view [7, 4, 3] -> [7, -1] (inner dim sharded)",
       {7, 4, 3},
       {Shard(2)},
       {kept_if(3 % n == 0, StridedShard(1, 4))},
       [](const at::Tensor& t) {
         return t.view({7, -1});
       }},
      {"view [7, 3, 4] -> [7, 12] (inner dim sharded)",
       {7, 3, 4},
       {Shard(2)},
       {kept_if(4 % n == 0, StridedShard(1, 3))},
       [](const at::Tensor& t) {
         return t.view({7, 12});
       }},
      {"view [7, 3, 4] -> [7, 12] -> [7, 3, 4]",
       {7, 3, 4},
       {Shard(2)},
       {kept_if(4 % n == 0, Shard(2))},
       [](const at::Tensor& t) {
         return t.view({7, 12}).view({7, 3, 4});
       }},
      {"view [7, 12] -> [7, 2, 6] (other dim sharded)",
       {7, 12},
       {Shard(0)},
       {Shard(0)},
       [](const at::Tensor& t) {
         return t.view({7, 2, 6});
       }},
      {"flatten(0, 1) of [7, 4, 3]",
       {7, 4, 3},
       {Shard(0)},
       {kept_if(7 % n == 0, Shard(0))},
       [](const at::Tensor& t) { return t.flatten(0, 1); }},
      {"reshape of a transpose",
       {12, 7},
       {Shard(0)},
       {kept_if(4 % n == 0, Shard(1))},
       [](const at::Tensor& t) {
         return t.t().reshape({7, 4, 3});
       }},
      {"unsqueeze(0)",
       {7, 12},
       {Shard(1)},
       {Shard(2)},
       [](const at::Tensor& t) { return t.unsqueeze(0); }},
      {"unsqueeze(0).squeeze(0)",
       {7, 12},
       {Shard(1)},
       {Shard(1)},
       [](const at::Tensor& t) { return t.unsqueeze(0).squeeze(0); }},
      {"select(0, 2)",
       {7, 12},
       {Shard(1)},
       {Shard(0)},
       [](const at::Tensor& t) { return t.select(0, 2); }},
      {"select(1, 5) (the sharded dim)",
       {7, 12},
       {Shard(1)},
       {Replicate()},
       [](const at::Tensor& t) { return t.select(1, 5); }},
      {"slice of the sharded dim",
       {7, 12},
       {Shard(0)},
       {Replicate()},
       [](const at::Tensor& t) { return t.slice(0, 1, 6, 2); }},
      {"slice of another dim",
       {7, 12},
       {Shard(0)},
       {Shard(0)},
       [](const at::Tensor& t) { return t.slice(1, 2, 9); }},
  });
}

// The shard follows its dim through transpose and permute; expand keeps a
// shard of a dim it does not broadcast.
TEST(DTensorOps, TransposePermuteAndExpand) {
  check_views({
      {"permute({2, 0, 1})",
       {7, 3, 10},
       {Shard(2)},
       {Shard(0)},
       [](const at::Tensor& t) {
         return t.permute({2, 0, 1});
       }},
      {"transpose(0, 2)",
       {7, 3, 10},
       {Shard(0)},
       {Shard(2)},
       [](const at::Tensor& t) { return t.transpose(0, 2); }},
      {"t()", {7, 10}, {Shard(0)}, {Shard(1)}, [](const at::Tensor& t) { return t.t(); }},
      {"t().contiguous()",
       {7, 10},
       {Shard(0)},
       {Shard(1)},
       [](const at::Tensor& t) { return t.t().contiguous(); }},
      {"transpose(-1, -2) * 2",
       {7, 10},
       {Shard(1)},
       {Shard(0)},
       [](const at::Tensor& t) { return t.transpose(-1, -2) * 2; }},
  });
  // Expand sums the gradient over the broadcast dims: reordered sums.
  struct Case {
    std::string name;
    std::vector<int64_t> shape;
    Placements in, out;
    std::vector<int64_t> size;
    std::vector<int64_t> summed;  // dims of the result summed into the gradient
  };
  const std::vector<Case> cases = {
      {"[7, 1] -> [7, 10]", {7, 1}, {Shard(0)}, {Shard(0)}, {7, 10}, {1}},
      {"[10] -> [7, 10]", {10}, {Shard(0)}, {Shard(1)}, {7, 10}, {0}},
      {"[7, 1] -> [3, 7, 10] (the size-1 dim sharded)",
       {7, 1},
       {Shard(1)},
       {Replicate()},
       {3, 7, 10},
       {0, 2}},
      {"[7, 1] -> [-1, 10]", {7, 1}, {Shard(0)}, {Shard(0)}, {-1, 10}, {1}},
  };
  uint64_t seed = 200;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name + " of " + to_string(k.in));
    const at::Tensor x = data(k.shape, ++seed);
    at::Tensor X = dleaf(x, k.in), rx = rleaf(x);
    at::Tensor out = X.expand(k.size), rout = rx.expand(k.size);
    EXPECT_TRUE(holds(out, k.out, rout, exact()));
    const at::Tensor c = data(rout.sizes(), ++seed);
    readout(out, c).backward();
    (rout * c).sum().backward();
    int64_t count = 1;
    for (int64_t d : k.summed) count *= rout.size(d);
    const at::Tensor g_bound = sum_bound(c.abs().sum(k.summed).reshape(x.sizes()), count);
    EXPECT_TRUE(holds(X.grad(), k.in, rx.grad(), g_bound));
  }
}

// split along a sharded dim gathers it, along another dim keeps the shard;
// cat and stack take the first input's layout (the joined dim of cat
// gathered).
TEST(DTensorOps, SplitCatAndStack) {
  const at::Tensor x = data({7, 10}, 51), y = data({7, 10}, 52);
  struct Case {
    std::string name;
    Placements x, y;
    std::vector<Placements> out;
    std::function<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&)> op;
  };
  const Placements s0{Shard(0)}, s1{Shard(1)}, s2{Shard(2)}, r{Replicate()};
  const std::vector<Case> cases = {
      {"split(3, 0) of S(1)",
       s1,
       r,
       {s1, s1, s1},
       [](const at::Tensor& a, const at::Tensor&) { return a.split(3, 0); }},
      {"split(4, 1) of S(1)",
       s1,
       r,
       {r, r, r},
       [](const at::Tensor& a, const at::Tensor&) { return a.split(4, 1); }},
      {"split_with_sizes({2, 5}, 0) of S(1)",
       s1,
       r,
       {s1, s1},
       [](const at::Tensor& a, const at::Tensor&) {
         return a.split_with_sizes({2, 5}, 0);
       }},
      {"chunk(2, 1) of S(1)",
       s1,
       r,
       {r, r},
       [](const at::Tensor& a, const at::Tensor&) { return a.chunk(2, 1); }},
      {"unbind(0) of S(1)", s1, r, std::vector<Placements>(7, s0),
       [](const at::Tensor& a, const at::Tensor&) { return a.unbind(0); }},
      {"cat(1) of S(0), S(0)",
       s0,
       s0,
       {s0},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::cat({a, b}, 1)};
       }},
      // Equal blocks evenly sharded along the joined dim join into a
      // strided shard of the result; 7 rows split evenly only on 1 rank.
      {"cat(0) of S(0), S(0)",
       s0,
       s0,
       {ranks() == 1 ? Placements{StridedShard(0, 2)} : r},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::cat({a, b}, 0)};
       }},
      {"cat(1) of S(0), R",
       s0,
       r,
       {s0},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::cat({a, b}, 1)};
       }},
      {"cat(1) of R, S(0)",
       r,
       s0,
       {r},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::cat({a, b}, 1)};
       }},
      {"stack(0) of S(1), S(1)",
       s1,
       s1,
       {s2},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::stack({a, b}, 0)};
       }},
      {"stack(2) of S(0), S(1)",
       s0,
       s1,
       {s0},
       [](const at::Tensor& a, const at::Tensor& b) {
         return std::vector<at::Tensor>{at::stack({a, b}, 2)};
       }},
  };
  uint64_t seed = 300;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    at::Tensor X = dleaf(x, k.x), Y = dleaf(y, k.y), rx = rleaf(x), ry = rleaf(y);
    std::vector<at::Tensor> out = k.op(X, Y), rout = k.op(rx, ry);
    ASSERT_EQ(out.size(), k.out.size());
    ASSERT_EQ(rout.size(), k.out.size());
    at::Tensor loss, rloss;
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_TRUE(holds(out[i], k.out[i], rout[i], exact())) << "piece " << i;
      const at::Tensor c = data(rout[i].sizes(), ++seed);
      loss = i == 0 ? readout(out[i], c) : loss + readout(out[i], c);
      rloss = i == 0 ? (rout[i] * c).sum() : rloss + (rout[i] * c).sum();
    }
    loss.backward();
    rloss.backward();
    // Each element's gradient is one c element (or 0): exact.
    EXPECT_TRUE(holds(X.grad(), k.x, rx.grad(), exact()));
    if (ry.grad().defined()) {
      EXPECT_TRUE(holds(Y.grad(), k.y, ry.grad(), exact()));
    }
  }

  // Blocks of 12 columns split evenly on 1 to 4 ranks: cat(1) of them is a
  // strided shard, and its gradient splits back into plain shards.
  const at::Tensor a = data({7, 12}, 53), b = data({7, 12}, 54), c = data({7, 24}, 55);
  at::Tensor A = dleaf(a, s1), B = dleaf(b, s1), ra = rleaf(a), rb = rleaf(b);
  at::Tensor out = at::cat({A, B}, 1), rout = at::cat({ra, rb}, 1);
  EXPECT_TRUE(holds(out, {StridedShard(1, 2)}, rout, exact()));
  readout(out, c).backward();
  (rout * c).sum().backward();
  EXPECT_TRUE(holds(A.grad(), s1, ra.grad(), exact()));
  EXPECT_TRUE(holds(B.grad(), s1, rb.grad(), exact()));
}

// ---- layer norm --------------------------------------------------------------------

// Batch-sharded input: each rank normalizes its own rows with the same
// per-row kernel as the whole tensor (bit-identical); the weight and bias
// gradients sum over rows across ranks (reordered). A hidden-sharded input
// is gathered and normalized whole (Replicate).
TEST(DTensorOps, LayerNormForwardAndBackward) {
  const int64_t B = 7, T = 3, H = 10;
  const at::Tensor x = data({B, T, H}, 61), w = data({H}, 62), b = data({H}, 63),
                   c = data({B, T, H}, 64);
  const at::Tensor xhat = F::layer_norm(x, F::LayerNormFuncOptions({H}));
  const at::Tensor w_bound = sum_bound((c * xhat).abs().sum(at::IntArrayRef{0, 1}), B * T);
  const at::Tensor b_bound = sum_bound(c.abs().sum(at::IntArrayRef{0, 1}), B * T);
  for (const Placements& in : {Placements{Shard(0)}, Placements{Shard(1)}, Placements{Shard(2)}}) {
    SCOPED_TRACE(to_string(in));
    const Placements out = in[0].is_shard(2) ? Placements{Replicate()} : in;
    at::Tensor X = dleaf(x, in), W = dleaf(w, {Replicate()}), Bias = dleaf(b, {Replicate()});
    at::Tensor rx = rleaf(x), rw = rleaf(w), rb = rleaf(b);
    at::Tensor y = F::layer_norm(X, F::LayerNormFuncOptions({H}).weight(W).bias(Bias));
    at::Tensor ry = F::layer_norm(rx, F::LayerNormFuncOptions({H}).weight(rw).bias(rb));
    EXPECT_TRUE(holds(y, out, ry, exact()));
    readout(y, c).backward();
    (ry * c).sum().backward();
    EXPECT_TRUE(holds(X.grad(), in, rx.grad(), exact()));
    EXPECT_TRUE(holds(W.grad(), {Replicate()}, rw.grad(), w_bound));
    EXPECT_TRUE(holds(Bias.grad(), {Replicate()}, rb.grad(), b_bound));
  }
}

// ---- pointwise, factories, in-place, plain tensors ------------------------------

// A plain tensor mixed in counts as Replicate (sliced locally where the
// DTensor is sharded), whichever argument it is.
TEST(DTensorOps, PlainTensorCountsAsReplicate) {
  const at::Tensor x = data({7, 10}, 71), y = data({7, 10}, 72), w = data({10, 5}, 73);
  const at::Tensor mask = y > 0, scalar = at::full({}, 1.5, at::kDouble);
  at::Tensor X = distribute(x, on_line({Shard(0)}));
  EXPECT_TRUE(holds(X + y, {Shard(0)}, x + y, exact()));
  EXPECT_TRUE(holds(y + X, {Shard(0)}, y + x, exact()));
  EXPECT_TRUE(holds(X * scalar, {Shard(0)}, x * scalar, exact()));
  EXPECT_TRUE(holds(at::where(mask, X, y), {Shard(0)}, at::where(mask, x, y), exact()));
  EXPECT_TRUE(holds(X.masked_fill(mask, -1.0), {Shard(0)}, x.masked_fill(mask, -1.0), exact()));
  EXPECT_TRUE(holds(y.mm(distribute(w, on_line({Shard(1)}))), {Shard(1)}, y.mm(w), mm_bound(y, w)));
  // Element-wise transcendental: kFn (see the top of the file), then one
  // more rounding of the sum on each side.
  EXPECT_TRUE(holds(X.tanh() + y, {Shard(0)}, x.tanh() + y,
                    kFn * x.tanh().abs() + 2 * kU * (x.tanh() + y).abs()));
  EXPECT_TRUE(holds(X.exp(), {Shard(0)}, x.exp(), kFn * x.exp()));
}

// Element-wise ops take the shard of their sharded input, forward and
// backward. Ops built from +, -, *, /, sqrt and comparisons round the same
// way on both sides (bound 0); the others are bounded next to each case.
TEST(DTensorOps, PointwiseOpsFollowTheShard) {
  const at::Tensor x = data({7, 10}, 191);
  struct Case {
    std::string name;
    std::function<at::Tensor(const at::Tensor&)> op;
    // Bounds from the input x, the reference output y and the gradient g
    // reaching the output.
    std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y)> forward;
    std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y, const at::Tensor& g)>
        backward;
  };
  auto zero = [](const at::Tensor&, const at::Tensor&) { return exact(); };
  auto zero_g = [](const at::Tensor&, const at::Tensor&, const at::Tensor&) { return exact(); };
  const std::vector<Case> cases = {
      {"relu", [](const at::Tensor& t) { return t.relu(); }, zero, zero_g},
      {"x * 2 - 1", [](const at::Tensor& t) { return t * 2 - 1; }, zero, zero_g},
      {"pow(2)", [](const at::Tensor& t) { return t.pow(2); }, zero, zero_g},
      {"sqrt(|x| + 1)", [](const at::Tensor& t) { return (t.abs() + 1).sqrt(); }, zero, zero_g},
      {"to(float)", [](const at::Tensor& t) { return t.to(at::kFloat); }, zero, zero_g},
      // exp: kFn; its gradient g exp(x) carries it, plus the product's
      // rounding on each side.
      {"exp", [](const at::Tensor& t) { return t.exp(); },
       [](const at::Tensor&, const at::Tensor& y) { return kFn * y.abs(); },
       [](const at::Tensor&, const at::Tensor& y, const at::Tensor& g) {
         return (kFn + 2 * kU) * (g * y).abs();
       }},
      // tanh: kFn; its gradient g (1 - y^2) moves by 2 |y| kFn |y| through
      // y, and rounds y^2, 1 - y^2 and the product on each side.
      {"tanh", [](const at::Tensor& t) { return t.tanh(); },
       [](const at::Tensor&, const at::Tensor& y) { return kFn * y.abs(); },
       [](const at::Tensor&, const at::Tensor& y, const at::Tensor& g) {
         return g.abs() * ((2 * kFn + 2 * kU) * y * y + 4 * kU * (1 - y * y).abs());
       }},
      // gelu(x) = x/2 (1 + erf(x/√2)), both sides together: erf's kFn
      // (6u absolute), the rounding of x/√2 (erf'(z) z <= 0.49, so 0.49u per
      // side) and of 1 + erf (2u per side), all times |x|/2: 5.5u |x|; the
      // final product rounds by u |y| <= u |x| per side: < 8u |x|.
      {"gelu", [](const at::Tensor& t) { return at::gelu(t); },
       [](const at::Tensor& t, const at::Tensor&) { return 8 * kU * t.abs(); },
       // gelu' = Φ(x) + x φ(x), both sides together: Φ as above, 5.5u;
       // φ = exp(-x^2/2) / √(2π) relatively (x^2 + 10) u (exp's kFn, the
       // roundings of x^2, of the factor and of the product with x), times
       // |x| φ <= 0.25 and |x|^3 φ <= 0.47: 2.9u; the sum and the product
       // with g round by u |Φ + x φ| <= 1.13u each per side: 4.6u. < 13u |g|.
       [](const at::Tensor&, const at::Tensor&, const at::Tensor& g) { return 13 * kU * g.abs(); }},
  };
  uint64_t seed = 400;
  for (const Placements& in : {Placements{Shard(0)}, Placements{Shard(1)}}) {
    for (const auto& k : cases) {
      SCOPED_TRACE(k.name + " of " + to_string(in));
      at::Tensor X = dleaf(x, in), rx = rleaf(x);
      at::Tensor y = k.op(X), ry = k.op(rx);
      const at::Tensor rd = ry.detach().to(at::kDouble);
      EXPECT_TRUE(holds(y, in, ry, k.forward(x, rd)));
      const at::Tensor c = data(ry.sizes(), ++seed).to(ry.scalar_type());
      readout(y, c).backward();
      (ry * c).sum().backward();
      EXPECT_TRUE(holds(X.grad(), in, rx.grad(), k.backward(x, rd, c.to(at::kDouble))));
    }
  }

  // Broadcasting: a [10] bias or a [7, 1] column follows the [7, 10] input's
  // shard (sliced locally, or kept where it shards the same dim); their
  // gradients sum over the broadcast dim, reordered.
  const at::Tensor bias = data({10}, 192), col = data({7, 1}, 193).abs() + 1,
                   c = data({7, 10}, 194);
  struct Broadcast {
    Placements x, bias, col, out;
  };
  for (const auto& k :
       std::vector<Broadcast>{{{Shard(1)}, {Shard(0)}, {Replicate()}, {Shard(1)}},
                              {{Shard(1)}, {Replicate()}, {Replicate()}, {Shard(1)}},
                              {{Shard(0)}, {Replicate()}, {Shard(0)}, {Shard(0)}},
                              {{Replicate()}, {Shard(0)}, {Replicate()}, {Shard(1)}}}) {
    SCOPED_TRACE(to_string(k.x) + " + " + to_string(k.bias) + " bias, / " + to_string(k.col) +
                 " column");
    at::Tensor X = dleaf(x, k.x), Bias = dleaf(bias, k.bias), Col = dleaf(col, k.col);
    at::Tensor rx = rleaf(x), rb = rleaf(bias), rc = rleaf(col);
    at::Tensor y = (X + Bias) / Col, ry = (rx + rb) / rc;
    EXPECT_TRUE(holds(y, k.out, ry, exact()));
    readout(y, c).backward();
    (ry * c).sum().backward();
    EXPECT_TRUE(holds(X.grad(), k.x, rx.grad(), exact()));
    EXPECT_TRUE(holds(Bias.grad(), k.bias, rb.grad(), sum_bound((c / col).abs().sum(0), 7)));
    EXPECT_TRUE(holds(Col.grad(), k.col, rc.grad(),
                      sum_bound((c * (x + bias) / (col * col)).abs().sum(1, true), 10)));
  }

  // where and masked_fill pass the gradient through where selected.
  const at::Tensor other = data({7, 10}, 195), mask = other > 0;
  at::Tensor X = dleaf(x, {Shard(1)}), O = dleaf(other, {Shard(0)});
  at::Tensor rx = rleaf(x), ro = rleaf(other);
  at::Tensor y = at::where(mask, X, O).masked_fill(x > 0.5, 0.0);
  at::Tensor ry = at::where(mask, rx, ro).masked_fill(x > 0.5, 0.0);
  EXPECT_TRUE(holds(y, {Shard(1)}, ry, exact()));
  readout(y, c).backward();
  (ry * c).sum().backward();
  EXPECT_TRUE(holds(X.grad(), {Shard(1)}, rx.grad(), exact()));
  EXPECT_TRUE(holds(O.grad(), {Shard(0)}, ro.grad(), exact()));
}

// Partial survives linear ops (sum of Partials, times a Replicate) and is
// reduced first by the others.
TEST(DTensorOps, PartialThroughPointwiseOps) {
  const int64_t M = 7, K = 10, N = 5;
  const at::Tensor a = data({M, K}, 81), b = data({K, N}, 82), a2 = data({M, K}, 83),
                   b2 = data({K, N}, 84), y = data({M, N}, 85);
  at::Tensor P = distribute(a, on_line({Shard(1)})).mm(distribute(b, on_line({Shard(0)})));
  at::Tensor Q = distribute(a2, on_line({Shard(1)})).mm(distribute(b2, on_line({Shard(0)})));
  at::Tensor Y = distribute(y, on_line({Replicate()}));
  const at::Tensor p = a.mm(b), q = a2.mm(b2);
  const at::Tensor pb = mm_bound(a, b);
  ASSERT_TRUE(holds(P, {Partial()}, p, pb));
  // p ± q: one sum of 2K terms.
  const at::Tensor both = sum_bound(a.abs().mm(b.abs()) + a2.abs().mm(b2.abs()), 2 * K);
  EXPECT_TRUE(holds(P + Q, {Partial()}, p + q, both));
  EXPECT_TRUE(holds(P - Q, {Partial()}, p - q, both));
  // p * y: each term scaled by y (once, before or after the sum).
  EXPECT_TRUE(holds(P * Y, {Partial()}, p * y, sum_bound(a.abs().mm(b.abs()) * y.abs(), K)));
  EXPECT_TRUE(holds(P * 3.0, {Partial()}, p * 3.0, 3 * pb));
  EXPECT_TRUE(holds(-P, {Partial()}, -p, pb));
  // p + y: y is one more term of the sum.
  EXPECT_TRUE(holds(P + Y, {Replicate()}, p + y, sum_bound(a.abs().mm(b.abs()) + y.abs(), K + 1)));
  // exp(p): p's error (first order, e^δ - 1 <= 2δ) and exp's kFn.
  EXPECT_TRUE(holds(P.exp(), {Replicate()}, p.exp(), p.exp() * (2 * pb + kFn)));
  // p * p: 2 |p| δ + δ^2, plus the product's rounding on each side.
  EXPECT_TRUE(holds(P * P, {Replicate()}, p * p, (2 * p.abs() + pb) * pb + 2 * kU * p * p));
}

// *_like keeps the template's layout (a Partial template gives Replicate:
// ones_like of a Partial must not sum to n); new_* of the template's size
// does too, of another size it is Replicate.
TEST(DTensorOps, FactoriesFollowTheTemplate) {
  const at::Tensor x = data({7, 10}, 91), a = data({7, 10}, 92), b = data({10, 5}, 93);
  at::Tensor X = distribute(x, on_line({Shard(1)}));
  const Placements s1{Shard(1)}, r{Replicate()};
  EXPECT_TRUE(holds(at::zeros_like(X), s1, at::zeros_like(x), exact()));
  EXPECT_TRUE(holds(at::ones_like(X), s1, at::ones_like(x), exact()));
  EXPECT_TRUE(holds(at::full_like(X, 2.5), s1, at::full_like(x, 2.5), exact()));
  EXPECT_TRUE(holds(X.new_zeros({7, 10}), s1, at::zeros({7, 10}, at::kDouble), exact()));
  EXPECT_TRUE(holds(X.new_ones({3}), r, at::ones({3}, at::kDouble), exact()));
  EXPECT_TRUE(holds(X.new_full({7, 10}, 1.5), s1, at::full({7, 10}, 1.5, at::kDouble), exact()));
  EXPECT_TRUE(holds(X.new_full({2, 3}, 1.5), r, at::full({2, 3}, 1.5, at::kDouble), exact()));
  for (const at::Tensor& t : {at::empty_like(X), at::rand_like(X), X.new_empty({7, 10})}) {
    ASSERT_TRUE(is_dtensor(t));
    EXPECT_EQ(layout_of(t).placements(), s1);
    EXPECT_EQ(t.sizes(), x.sizes());
    EXPECT_EQ(local_of(t).sizes(), local_of(X).sizes());
  }
  at::Tensor P = distribute(a, on_line({Shard(1)})).mm(distribute(b, on_line({Shard(0)})));
  ASSERT_EQ(layout_of(P).placements(), Placements{Partial()});
  EXPECT_TRUE(holds(at::ones_like(P), r, at::ones({7, 5}, at::kDouble), exact()));
  EXPECT_TRUE(holds(at::zeros_like(P), r, at::zeros({7, 5}, at::kDouble), exact()));
}

// An in-place op keeps self's layout (and self), redistributing the other
// operands to it.
TEST(DTensorOps, InPlaceOpsKeepTheLayout) {
  const int64_t M = 7, K = 10, N = 5;
  const at::Tensor x = data({M, N}, 101), y = data({M, N}, 102), z = data({M, N}, 103),
                   a = data({M, K}, 104), b = data({K, N}, 105);
  const at::Tensor mask = y > 0;
  at::Tensor X = distribute(x, on_line({Shard(0)}));
  at::Tensor Y = distribute(y, on_line({Replicate()}));
  at::Tensor Z = distribute(z, on_line({Shard(1)}));
  at::Tensor expected = x.clone();
  const c10::TensorImpl* self = X.unsafeGetTensorImpl();
  // Each op returns self, and self holds what the same ops did to `expected`.
  auto check = [&](const char* what, const at::Tensor& result, const at::Tensor& bound) {
    SCOPED_TRACE(what);
    EXPECT_EQ(result.unsafeGetTensorImpl(), self);
    EXPECT_TRUE(holds(X, {Shard(0)}, expected, bound));
  };
  expected.add_(y);
  check("add_(R)", X.add_(Y), exact());
  expected.sub_(z);
  check("sub_(S(1))", X.sub_(Z), exact());
  expected.mul_(2.0);
  check("mul_(2.0)", X.mul_(2.0), exact());
  expected.masked_fill_(mask, 3.0);
  check("masked_fill_(plain mask)", X.masked_fill_(mask, 3.0), exact());
  expected.clamp_(-0.5, 0.5);
  check("clamp_", X.clamp_(-0.5, 0.5), exact());
  expected.copy_(z);
  check("copy_(S(1))", X.copy_(Z), exact());
  // Adding a Partial reduces it onto self's shards: self is one more term.
  at::Tensor P = distribute(a, on_line({Shard(1)})).mm(distribute(b, on_line({Shard(0)})));
  const at::Tensor add_bound = sum_bound(a.abs().mm(b.abs()) + expected.abs(), K + 1);
  expected.add_(a.mm(b));
  check("add_(P)", X.add_(P), add_bound);
  expected.zero_();
  check("zero_", X.zero_(), exact());

  // A Partial self stays Partial under linear in-place ops.
  const c10::TensorImpl* partial = P.unsafeGetTensorImpl();
  EXPECT_EQ(P.mul_(3.0).unsafeGetTensorImpl(), partial);
  EXPECT_EQ(P.add_(Y).unsafeGetTensorImpl(), partial);
  const at::Tensor expected_p = a.mm(b) * 3.0 + y;
  const at::Tensor bound_p = sum_bound(3 * a.abs().mm(b.abs()) + y.abs(), K + 1);
  EXPECT_TRUE(holds(P, {Partial()}, expected_p, bound_p));
}

// ---- autograd and training -----------------------------------------------------

// A column-parallel layer, a vocabulary-parallel embedding and a
// row-parallel layer, each read out separately so every gradient is one
// sum of exact operands.
struct Branches {
  static constexpr int64_t B = 7, T = 3, D = 5, H = 10, V = 11;
  at::Tensor x = data({B, T, D}, 131), w1 = data({H, D}, 132), b1 = data({H}, 133),
             table = data({V, D}, 134), xs = data({B, T, H}, 135), w2 = data({D, H}, 136),
             b2 = data({D}, 137), c1 = data({B, T, H}, 138), c2 = data({B, T, D}, 139),
             c3 = data({B, T, D}, 140);
  at::Tensor ids = at::arange(B * T, at::kLong).remainder(V).reshape({B, T});

  // The leaves in the order forward() takes them.
  static at::Tensor forward(const std::vector<at::Tensor>& p, const at::Tensor& ids,
                            const at::Tensor& xs_input, const at::Tensor& c1, const at::Tensor& c2,
                            const at::Tensor& c3, bool dtensor) {
    auto read = [&](const at::Tensor& out, const at::Tensor& c) {
      return dtensor ? readout(out, c) : (out * c).sum();
    };
    return read(F::linear(p[0], p[1], p[2]), c1) + read(F::embedding(ids, p[3]), c2) +
           read(F::linear(xs_input, p[4], p[5]), c3);
  }

  std::vector<at::Tensor> grad_bounds() const {
    const at::Tensor c1f = c1.reshape({B * T, H}), c3f = c3.reshape({B * T, D});
    return {
        mm_bound(c1, w1),                                       // x
        mm_bound(c1f.t(), x.reshape({B * T, D})),               // w1
        sum_bound(c1.abs().sum(at::IntArrayRef{0, 1}), B * T),  // b1
        sum_bound(
            at::zeros({V, D}, at::kDouble).index_add(0, ids.reshape(-1), c2.abs().reshape({-1, D})),
            B * T),                                             // table
        mm_bound(c3f.t(), xs.reshape({B * T, H})),              // w2
        sum_bound(c3.abs().sum(at::IntArrayRef{0, 1}), B * T),  // b2
    };
  }
};

// Gradients of DTensor leaves are DTensors in the leaf's own layout, even
// where the rules produce them in another (the embedding table's and x's
// arrive Replicate or Partial), and accumulate across backwards.
TEST(DTensorOps, LeafGradientsKeepTheLeafLayoutAndAccumulate) {
  Branches m;
  const std::vector<Placements> layouts = {{Replicate()}, {Shard(0)}, {Shard(0)},
                                           {Shard(0)},    {Shard(1)}, {Replicate()}};
  const std::vector<at::Tensor> full = {m.x, m.w1, m.b1, m.table, m.w2, m.b2};
  std::vector<at::Tensor> leaves, refs;
  for (size_t i = 0; i < full.size(); ++i) {
    leaves.push_back(dleaf(full[i], layouts[i]));
    refs.push_back(rleaf(full[i]));
  }
  at::Tensor Xs = distribute(m.xs, on_line({Shard(2)}));
  const auto bounds = m.grad_bounds();
  for (int pass = 1; pass <= 2; ++pass) {
    SCOPED_TRACE("backward " + std::to_string(pass));
    Branches::forward(leaves, m.ids, Xs, m.c1, m.c2, m.c3, true).backward();
    Branches::forward(refs, m.ids, m.xs, m.c1, m.c2, m.c3, false).backward();
    // Both sides repeat the same operations, so each accumulated gradient is
    // exactly `pass` times its first one.
    for (size_t i = 0; i < leaves.size(); ++i) {
      SCOPED_TRACE("leaf " + std::to_string(i));
      EXPECT_TRUE(holds(leaves[i].grad(), layouts[i], refs[i].grad(), pass * bounds[i]));
    }
  }
}

// AdamW steps DTensor parameters (column- then row-parallel linear, a plain
// input): after each step every parameter matches the reference within
// what AdamWBound derives from the gradients' bounds. Each step starts both
// runs from equal parameters (the reference takes the gathered ones),
// which is what AdamWBound assumes; the moments' intervals carry over.
TEST(DTensorOps, AdamWStepsDTensorParameters) {
  const int64_t B = 7, D = 5, H = 10;
  const at::Tensor x = data({B, D}, 141), c = data({B, D}, 142);
  // b2 [5] sharded leaves one rank an empty shard on 4 ranks; s is a
  // Replicate scale of the output.
  const std::vector<std::string> names = {"w1", "b1", "w2", "b2", "s"};
  const std::vector<Placements> layouts = {
      {Shard(0)}, {Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}};
  const std::vector<at::Tensor> init = {data({H, D}, 143), data({H}, 144), data({D, H}, 145),
                                        data({D}, 146), data({D}, 147)};
  std::vector<at::Tensor> params, refs;
  for (size_t i = 0; i < init.size(); ++i) {
    params.push_back(dleaf(init[i], layouts[i]));
    refs.push_back(rleaf(init[i]));
  }
  test::AdamWHyper hyper;
  hyper.lr = 0.05;
  auto options = [&] {
    return torch::optim::AdamWOptions(hyper.lr)
        .betas({hyper.beta1, hyper.beta2})
        .eps(hyper.eps)
        .weight_decay(hyper.weight_decay);
  };
  torch::optim::AdamW opt(params, options()), ref_opt(refs, options());
  test::AdamWBound adam(hyper);
  auto loss_of = [&](const std::vector<at::Tensor>& p) {
    return (F::linear(F::linear(x, p[0], p[1]), p[2], p[3]) * p[4] * c).sum();
  };
  for (int step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) refs[i].copy_(full_tensor(params[i]));
    }
    opt.zero_grad();
    ref_opt.zero_grad();
    loss_of(params).backward();
    loss_of(refs).backward();
    // Gradient bounds, first order: h = x w1^T + b1 (D + 1 terms); the
    // gradient reaching y = h w2^T + b2 is cs = c s, the same bits on both
    // sides; dw2 = cs^T h over B rows carries h's error; ds = Σ c y is a sum
    // of B (H + 1) products and carries h's error through w2; gh = cs w2
    // (D terms); dw1 = gh^T x and db1 = Σ gh carry gh's.
    const at::Tensor w1 = refs[0].detach(), b1 = refs[1].detach(), w2 = refs[2].detach(),
                     b2 = refs[3].detach(), scale = refs[4].detach();
    const at::Tensor h = F::linear(x, w1, b1);
    const at::Tensor h_bound = sum_bound(x.abs().mm(w1.abs().t()) + b1.abs(), D + 1);
    const at::Tensor cs = c * scale;
    const at::Tensor gh = cs.mm(w2), gh_bound = mm_bound(cs, w2);
    const std::vector<at::Tensor> grad_bounds = {
        mm_bound(gh.t(), x) + gh_bound.t().mm(x.abs()),
        sum_bound(gh.abs().sum(0), B) + gh_bound.sum(0),
        mm_bound(cs.t(), h) + cs.abs().t().mm(h_bound),
        sum_bound(cs.abs().sum(0), B),
        sum_bound((c.abs() * (h.abs().mm(w2.abs().t()) + b2.abs())).sum(0), B * (H + 1)) +
            (c.abs() * h_bound.mm(w2.abs().t())).sum(0),
    };
    std::vector<at::Tensor> bounds;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(holds(params[i].grad(), layouts[i], refs[i].grad(), grad_bounds[i]))
          << names[i] << " gradient";
      bounds.push_back(adam.step(names[i], refs[i].detach(), refs[i].grad(), grad_bounds[i]));
    }
    opt.step();
    ref_opt.step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(holds(params[i], layouts[i], refs[i].detach(), bounds[i])) << names[i];
    }
  }
}

// clip_grad_norm_ returns the global norm of sharded gradients and scales
// every shard by the same factor.
TEST(DTensorOps, ClipGradNormUsesTheGlobalNorm) {
  const std::vector<Placements> layouts = {{Shard(0)}, {Shard(1)}, {Replicate()}, {Shard(0)}};
  const std::vector<std::vector<int64_t>> shapes = {{10, 5}, {5, 10}, {5}, {11}};
  std::vector<at::Tensor> params, refs, grads;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const at::Tensor p = data(shapes[i], 150 + i);
    grads.push_back(data(shapes[i], 160 + i));
    params.push_back(dleaf(p, layouts[i]));
    refs.push_back(rleaf(p));
    // The same gradients on both sides: only the norm's summation order differs.
    params[i].mutable_grad() = distribute(grads[i], on_line(layouts[i]));
    refs[i].mutable_grad() = grads[i].clone();
  }
  double squares = 0;
  int64_t count = 0;
  for (const auto& g : grads) {
    squares += g.pow(2).sum().item<double>();
    count += g.numel();
  }
  const double ref_norm = std::sqrt(squares);
  const double max_norm = 0.5 * ref_norm;
  const double norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
  const double ref_returned = torch::nn::utils::clip_grad_norm_(refs, max_norm);
  // Σ g^2 over all elements in another order, plus each per-parameter norm
  // rounded (sqrt, then squared again: ~2u relative per term, inside the 4u
  // per term of the sum's bound with one term per parameter added to n); the
  // square root halves the relative error; both roots may differ by kFn.
  const double norm_bound =
      test::reordered_sum_bound(squares, count + static_cast<int64_t>(grads.size()), at::kDouble) /
          std::sqrt(squares) +
      kFn * ref_norm;
  EXPECT_TRUE(test::within_bound(norm, ref_returned, norm_bound));
  // coef = max_norm / (norm + 1e-6) moves by coef * Δnorm / norm to first
  // order, plus its division and addition (2u each side); each gradient
  // element is scaled by it with one more rounding on each side.
  const double coef = max_norm / (ref_norm + 1e-6);
  const double coef_bound = coef * norm_bound / ref_norm + 4 * kU * coef;
  for (size_t i = 0; i < params.size(); ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    EXPECT_TRUE(holds(params[i].grad(), layouts[i], refs[i].grad(),
                      grads[i].abs() * coef_bound + 2 * kU * refs[i].grad().abs()));
  }
}

// ---- the 2 x 2 mesh ----------------------------------------------------------------

// On a (dp, tp) mesh: a batch-sharded MLP block (column- then row-parallel),
// a vocabulary-parallel embedding of batch-sharded ids, layer norm and the
// loss over [S(0), S(1)] logits; each mesh dim follows its own rule.
TEST(DTensorOps, TwoByTwoMesh) {
  if (test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const DeviceMeshPtr mesh = grid();
  auto L = [&](Placements p) { return Layout(mesh, std::move(p)); };
  const int64_t B = 8, T = 3, D = 5, H = 10, V = 11;
  {
    SCOPED_TRACE("MLP block");
    const at::Tensor x = data({B, T, D}, 171), w1 = data({H, D}, 172), b1 = data({H}, 173),
                     w2 = data({D, H}, 174), b2 = data({D}, 175), c = data({B, T, D}, 176);
    at::Tensor X = dleaf(x, L({Shard(0), Replicate()})), W1 = dleaf(w1, L({Replicate(), Shard(0)})),
               B1 = dleaf(b1, L({Replicate(), Shard(0)})),
               W2 = dleaf(w2, L({Replicate(), Shard(1)})),
               B2 = dleaf(b2, L({Replicate(), Replicate()}));
    at::Tensor rx = rleaf(x), rw1 = rleaf(w1), rb1 = rleaf(b1), rw2 = rleaf(w2), rb2 = rleaf(b2);
    at::Tensor h = F::linear(X, W1, B1), rh = F::linear(rx, rw1, rb1);
    const at::Tensor h_bound = sum_bound(x.abs().matmul(w1.abs().t()) + b1.abs(), D + 1);
    EXPECT_TRUE(holds(h, {Shard(0), Shard(2)}, rh, h_bound));
    at::Tensor y = F::linear(h, W2, B2), ry = F::linear(rh, rw2, rb2);
    const at::Tensor rhd = rh.detach();
    EXPECT_TRUE(holds(y, {Shard(0), Partial()}, ry,
                      sum_bound(rhd.abs().matmul(w2.abs().t()) + b2.abs(), H + 1) +
                          h_bound.matmul(w2.abs().t())));
    at::Tensor loss = readout(y, c);
    EXPECT_EQ(layout_of(loss).placements(), (Placements{Partial(), Partial()}));
    loss.backward();
    (ry * c).sum().backward();
    const at::Tensor cf = c.reshape({B * T, D});
    const at::Tensor gh = c.matmul(w2), gh_bound = mm_bound(c, w2);
    EXPECT_TRUE(holds(
        W2.grad(), {Replicate(), Shard(1)}, rw2.grad(),
        mm_bound(cf.t(), rhd.reshape({B * T, H})) + cf.abs().t().mm(h_bound.reshape({B * T, H}))));
    EXPECT_TRUE(holds(B2.grad(), {Replicate(), Replicate()}, rb2.grad(),
                      sum_bound(c.abs().sum(at::IntArrayRef{0, 1}), B * T)));
    EXPECT_TRUE(holds(W1.grad(), {Replicate(), Shard(0)}, rw1.grad(),
                      mm_bound(gh.reshape({B * T, H}).t(), x.reshape({B * T, D})) +
                          gh_bound.reshape({B * T, H}).t().mm(x.reshape({B * T, D}).abs())));
    EXPECT_TRUE(holds(B1.grad(), {Replicate(), Shard(0)}, rb1.grad(),
                      sum_bound(gh.abs().sum(at::IntArrayRef{0, 1}), B * T) +
                          gh_bound.sum(at::IntArrayRef{0, 1})));
    EXPECT_TRUE(holds(X.grad(), {Shard(0), Replicate()}, rx.grad(),
                      mm_bound(gh, w1) + gh_bound.matmul(w1.abs())));
  }
  {
    SCOPED_TRACE("embedding");
    const at::Tensor table = data({V, D}, 177), c = data({B, T, D}, 178);
    const at::Tensor ids = at::arange(B * T, at::kLong).remainder(V).reshape({B, T});
    at::Tensor Table = dleaf(table, L({Replicate(), Shard(0)})), rt = rleaf(table);
    at::Tensor out = F::embedding(distribute(ids, L({Shard(0), Replicate()})), Table);
    at::Tensor rout = F::embedding(ids, rt);
    EXPECT_TRUE(holds(out, {Shard(0), Partial()}, rout, exact()));
    readout(out, c).backward();
    (rout * c).sum().backward();
    EXPECT_TRUE(holds(
        Table.grad(), {Replicate(), Shard(0)}, rt.grad(),
        sum_bound(
            at::zeros({V, D}, at::kDouble).index_add(0, ids.reshape(-1), c.abs().reshape({-1, D})),
            B * T)));
  }
  {
    SCOPED_TRACE("layer norm");
    const at::Tensor x = data({B, T, H}, 179), w = data({H}, 180), b = data({H}, 181),
                     c = data({B, T, H}, 182);
    at::Tensor X = dleaf(x, L({Shard(0), Shard(1)})), W = dleaf(w, L({Replicate(), Replicate()})),
               Bias = dleaf(b, L({Replicate(), Replicate()}));
    at::Tensor rx = rleaf(x), rw = rleaf(w), rb = rleaf(b);
    at::Tensor y = F::layer_norm(X, F::LayerNormFuncOptions({H}).weight(W).bias(Bias));
    at::Tensor ry = F::layer_norm(rx, F::LayerNormFuncOptions({H}).weight(rw).bias(rb));
    EXPECT_TRUE(holds(y, {Shard(0), Shard(1)}, ry, exact()));
    readout(y, c).backward();
    (ry * c).sum().backward();
    const at::Tensor xhat = F::layer_norm(x, F::LayerNormFuncOptions({H}));
    EXPECT_TRUE(holds(X.grad(), {Shard(0), Shard(1)}, rx.grad(), exact()));
    EXPECT_TRUE(holds(W.grad(), {Replicate(), Replicate()}, rw.grad(),
                      sum_bound((c * xhat).abs().sum(at::IntArrayRef{0, 1}), B * T)));
    EXPECT_TRUE(holds(Bias.grad(), {Replicate(), Replicate()}, rb.grad(),
                      sum_bound(c.abs().sum(at::IntArrayRef{0, 1}), B * T)));
  }
  {
    SCOPED_TRACE("views and sums");
    // Dim 0 of [S(0), S(0)] is split over all 4 ranks, in mesh-dim order.
    const Placements s00{Shard(0), Shard(0)}, s01{Shard(0), Shard(1)}, s0r{Shard(0), Replicate()};
    const Placements s11{Shard(1), Shard(1)}, rr{Replicate(), Replicate()};
    const std::vector<std::tuple<std::string, Placements, Placements,
                                 std::function<at::Tensor(const at::Tensor&)>>>
        cases = {
            {"view [8, 12] -> [4, 2, 12]", s00, s00,
             [](const at::Tensor& t) {
               return t.view({4, 2, 12});
             }},
            {"view [8, 12] -> [2, 4, 12]", s00, rr,
             [](const at::Tensor& t) {
               return t.view({2, 4, 12});
             }},
            {"view [8, 12] -> [8, 2, 6]", s01, s01,
             [](const at::Tensor& t) {
               return t.view({8, 2, 6});
             }},
            {"view [8, 12] -> [96]", s0r, s0r, [](const at::Tensor& t) { return t.view({96}); }},
            {"t()", s00, s11, [](const at::Tensor& t) { return t.t(); }},
            {"t().contiguous()", s01, (Placements{Shard(1), Shard(0)}),
             [](const at::Tensor& t) { return t.t().contiguous(); }},
        };
    uint64_t seed = 500;
    for (const auto& [name, in, out_placements, op] : cases) {
      SCOPED_TRACE(name + " of " + to_string(in));
      const at::Tensor x = data({8, 12}, ++seed);
      at::Tensor X = dleaf(x, L(in)), rx = rleaf(x);
      at::Tensor out = op(X), rout = op(rx);
      EXPECT_TRUE(holds(out, out_placements, rout, exact()));
      const at::Tensor c = data(rout.sizes(), ++seed);
      readout(out, c).backward();
      (rout * c).sum().backward();
      EXPECT_TRUE(holds(X.grad(), in, rx.grad(), exact()));
    }
    const at::Tensor x = data({8, 12}, 520);
    at::Tensor X = distribute(x, L(s01));
    EXPECT_TRUE(holds(X.sum(0), {Partial(), Shard(0)}, x.sum(0), sum_bound(x.abs().sum(0), 8)));
    EXPECT_TRUE(holds(X.sum(1), {Shard(0), Partial()}, x.sum(1), sum_bound(x.abs().sum(1), 12)));
    EXPECT_TRUE(holds(X.sum(), {Partial(), Partial()}, x.sum(), sum_bound(x.abs().sum(), 96)));
    EXPECT_TRUE(holds(distribute(x, L(s00)).sum(0), {Partial(), Partial()}, x.sum(0),
                      sum_bound(x.abs().sum(0), 8)));
  }
  {
    SCOPED_TRACE("loss over [S(0), S(1)] logits");
    const at::Tensor x = data({B, V}, 183) * 4;
    const at::Tensor target = at::tensor({0, 10, 3, 7, 4, 5, 10, 1}, at::kLong);
    at::Tensor X = dleaf(x, L({Shard(0), Shard(1)})), rx = rleaf(x);
    at::Tensor loss = F::cross_entropy(X, target), rloss = F::cross_entropy(rx, target);
    const at::Tensor ry = x.log_softmax(1), y_bound = log_softmax_bound(x, ry, 1);
    const at::Tensor index = target.unsqueeze(1);
    EXPECT_TRUE(holds(
        loss, {Partial(), Partial()}, rloss,
        (y_bound.gather(1, index).sum() + sum_bound(ry.gather(1, index).abs().sum(), B)) / B));
    loss.backward();
    rloss.backward();
    const at::Tensor g = at::zeros({B, V}, at::kDouble).scatter(1, index, -1.0 / B);
    EXPECT_TRUE(holds(X.grad(), {Shard(0), Shard(1)}, rx.grad(),
                      log_softmax_grad_bound(ry, y_bound, g, 1)));
  }
}

// ---- errors ----------------------------------------------------------------------

// An op without a rule names itself and its inputs' placements and shapes;
// nothing is gathered instead.
TEST(DTensorOps, OpWithoutRuleRaisesArgumentError) {
  const at::Tensor x = data({7, 5}, 111), y = data({7, 5}, 112);
  at::Tensor X = distribute(x, on_line({Shard(0)}));
  at::Tensor Y = distribute(y, on_line({Replicate()}));
  EXPECT_THAT([&] { at::cumsum(X, 1); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("aten::cumsum"),
                                                 HasSubstr("aten::cumsum([S(0)][7, 5])"),
                                                 HasSubstr("has no sharding rule"))));
  EXPECT_THAT([&] { X.sort(1); }, ThrowsMessage<ArgumentError>(
                                      AllOf(HasSubstr("aten::sort"), HasSubstr("([S(0)][7, 5])"),
                                            HasSubstr("has no sharding rule"))));
  EXPECT_THAT([&] { at::atan2(X, Y); },
              ThrowsMessage<ArgumentError>(HasSubstr("aten::atan2([S(0)][7, 5], [R][7, 5])")));
  EXPECT_THAT([&] { at::atan2(X, y); },
              ThrowsMessage<ArgumentError>(HasSubstr("aten::atan2([S(0)][7, 5], plain[7, 5])")));
  // An out= overload is not covered by its functional op's rule.
  at::Tensor out = distribute(at::zeros({5}, x.options()), on_line({Replicate()}));
  EXPECT_THAT([&] { at::sum_out(out, X, {0}); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("aten::sum.IntList_out"),
                                                 HasSubstr("has no sharding rule"))));
  // The next op still works: the error left nothing half done.
  EXPECT_TRUE(holds(X + Y, {Shard(0)}, x + y, exact()));
}

// Global sizes that libtorch would refuse on plain tensors are refused on
// DTensors too, with libtorch's own reason and the inputs' placements and
// shapes, before anything runs: shapes that do not broadcast (whatever the
// shards would make of them locally) and a view of another element count.
TEST(DTensorOps, MismatchedSizesRaiseArgumentError) {
  const at::Tensor x = data({7, 5}, 131), y = data({7, 3}, 132), z = data({4, 6}, 133);
  at::Tensor X = distribute(x, on_line({Shard(0)}));
  at::Tensor Y = distribute(y, on_line({Replicate()}));
  at::Tensor Z = distribute(z, on_line({Shard(1)}));
  EXPECT_THAT([&] { X + Y; },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("aten::add.Tensor([S(0)][7, 5], [R][7, 3])"),
                        HasSubstr("size of tensor a (5) must match"))));
  EXPECT_THAT([&] { at::mul(Z, z.narrow(1, 0, 3)); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("aten::mul.Tensor([S(1)][4, 6], plain[4, 3])"),
                        HasSubstr("at non-singleton dimension 1"))));
  EXPECT_THAT([&] { X.view({6, 6}); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("aten::view([S(0)][7, 5]"),
                                                 HasSubstr("invalid for input of size 35"))));
  // The next op still works: the error left nothing half done.
  EXPECT_TRUE(holds(X + X, {Shard(0)}, x + x, exact()));
}

// An in-place op that would have to change self's layout (a nonlinear op on
// a Partial self needs it reduced) is refused, and self is left unchanged.
TEST(DTensorOps, InPlaceOpThatWouldChangeSelfsLayoutRaises) {
  const at::Tensor a = data({7, 10}, 121), b = data({10, 5}, 122);
  at::Tensor P = distribute(a, on_line({Shard(1)})).mm(distribute(b, on_line({Shard(0)})));
  const at::Tensor local_before = local_of(P).clone();
  EXPECT_THAT([&] { P.exp_(); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("aten::exp_([P(sum)][7, 5])"), HasSubstr("in place"))));
  EXPECT_THAT([&] { P.clamp_(-1.0, 1.0); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("aten::clamp_([P(sum)][7, 5]"), HasSubstr("in place"))));
  EXPECT_TRUE(test::tensors_equal(local_of(P), local_before));
  EXPECT_EQ(layout_of(P).placements(), Placements{Partial()});
}

}  // namespace
}  // namespace hp
