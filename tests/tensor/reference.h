// Single-process references for DTensor tests: what each rank should hold,
// computed from the whole tensor with at::chunk, independently of the
// library's own sharding code.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "hp/tensor/layout.h"

namespace hp::test {

// How a Partial mesh dim splits a value into per-rank pieces.
enum class PartialStyle {
  kTestPieces,  // pieces chosen by the test (not the library's convention)
  kPartition,   // the library's convention (sum: coordinate 0 holds it)
};

// A small-integer-valued float tensor, so every sum in any order is exact.
at::Tensor integer_tensor(at::IntArrayRef shape, int salt = 0);

// Pieces of `value` for a Partial(op) mesh dim of `n` ranks, at `index`.
at::Tensor partial_piece(const at::Tensor& value, dist::ReduceOp op, int64_t n, int64_t index,
                         PartialStyle style, int64_t mesh_dim);

// The local tensor at `coordinate` for `full` laid out by `layout`; Partial
// mesh dims are split with styles[m]: kTestPieces dims first, then
// kPartition dims, each pass in mesh-dim order.
at::Tensor reference_local(const at::Tensor& full, const Layout& layout,
                           const std::vector<int64_t>& coordinate,
                           const std::vector<PartialStyle>& styles);

}  // namespace hp::test
