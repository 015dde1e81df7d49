#include "tests/tensor/reference.h"

namespace hp::test {

at::Tensor integer_tensor(at::IntArrayRef shape, int salt) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  return ((at::arange(numel, at::kLong) * 7 + salt) % 17 - 8).to(at::kFloat).view(shape);
}

at::Tensor partial_piece(const at::Tensor& value, dist::ReduceOp op, int64_t n, int64_t index,
                         PartialStyle style, int64_t mesh_dim) {
  if (style == PartialStyle::kPartition) {
    if (op == dist::ReduceOp::kSum && index != 0) return at::zeros_like(value);
    return value.clone();
  }
  // Offsets that vary per element and cancel (sum, avg) or stay below (max)
  // / above (min) the value at index 0.
  at::Tensor k = integer_tensor(value.sizes(), 3 + static_cast<int>(mesh_dim)) / 4 + 1;
  k = k.round();
  switch (op) {
    case dist::ReduceOp::kSum: return index == 0 ? value - (n - 1) * k : k.clone();
    case dist::ReduceOp::kAvg: return value + (2 * index - (n - 1)) * k;
    case dist::ReduceOp::kMax: return index == 0 ? value.clone() : value - 1 - index;
    case dist::ReduceOp::kMin: return index == 0 ? value.clone() : value + 1 + index;
  }
  return value;
}

at::Tensor reference_local(const at::Tensor& full, const Layout& layout,
                           const std::vector<int64_t>& coordinate,
                           const std::vector<PartialStyle>& styles) {
  const DeviceMesh& mesh = *layout.mesh();
  at::Tensor value = full;
  // The test's own pieces first (they are what a source was built from),
  // then the library's partitions, which a redistribute applies last.
  for (PartialStyle pass : {PartialStyle::kTestPieces, PartialStyle::kPartition}) {
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      const Placement& p = layout.placements()[m];
      if (p.is_partial() && styles[m] == pass) {
        value = partial_piece(value, p.reduce_op(), mesh.size(m), coordinate[m], pass, m);
      }
    }
  }
  for (int64_t d = 0; d < full.dim(); ++d) {
    for (int64_t m : layout.mesh_dims_of(d)) {
      auto pieces = at::chunk(value, mesh.size(m), d);
      const int64_t index = coordinate[m];
      value = index < static_cast<int64_t>(pieces.size()) ? pieces[index]
                                                          : value.narrow(d, value.size(d), 0);
    }
  }
  return value.contiguous();
}

}  // namespace hp::test
