#include "hp/tensor/redistribute_exec.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "hp/distributed/collectives.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using Kind = RedistributeStep::Kind;

struct StepContext {
  const RedistributeStep& step;
  const DeviceMesh& mesh;
  const std::vector<int64_t>& global_shape;
  dist::Group& group;
  int64_t ranks;  // group size
  int64_t me;     // this rank's index along the step's mesh dim
};

// Size along tensor dim d held by group member j under `spec`.
int64_t member_size(const StepContext& c, const ShardSpec& spec, int64_t d, int64_t j) {
  std::vector<int64_t> coord = c.mesh.coordinate();
  coord[c.step.mesh_dim] = j;
  return shard_span(c.global_shape[d], spec, d, c.mesh.shape(), coord).size;
}

// Copies `piece` (dim 0 of size <= rows) into a zero-padded [rows, ...] block.
at::Tensor pad_dim0(const at::Tensor& piece, int64_t rows) {
  if (piece.size(0) == rows) return piece.contiguous();
  std::vector<int64_t> shape = piece.sizes().vec();
  shape[0] = rows;
  at::Tensor padded = at::zeros(shape, piece.options());
  padded.narrow(0, 0, piece.size(0)).copy_(piece);
  return padded;
}

at::Tensor all_gather(const StepContext& c, const at::Tensor& x) {
  const int64_t d = c.step.tensor_dim;
  std::vector<int64_t> sizes(c.ranks);
  for (int64_t j = 0; j < c.ranks; ++j) sizes[j] = member_size(c, c.step.before, d, j);
  const int64_t rows = *std::max_element(sizes.begin(), sizes.end());
  at::Tensor piece = pad_dim0(x.movedim(d, 0), rows);
  std::vector<int64_t> out_shape = piece.sizes().vec();
  out_shape[0] = rows * c.ranks;
  at::Tensor gathered = at::empty(out_shape, x.options());
  dist::all_gather_into(c.group, gathered, piece).wait();
  const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == rows; });
  if (!even) {
    std::vector<at::Tensor> parts;
    for (int64_t j = 0; j < c.ranks; ++j) parts.push_back(gathered.narrow(0, j * rows, sizes[j]));
    gathered = at::cat(parts);
  }
  return gathered.movedim(0, d).contiguous();
}

at::Tensor chunk(const StepContext& c, const at::Tensor& x) {
  const int64_t d = c.step.tensor_dim;
  Span piece = chunk_span(x.size(d), c.ranks, c.me);
  return x.narrow(d, piece.offset, piece.size).clone(at::MemoryFormat::Contiguous);
}

at::Tensor all_reduce(const StepContext& c, const at::Tensor& x) {
  at::Tensor y = x.clone(at::MemoryFormat::Contiguous);
  dist::all_reduce(c.group, y, c.step.op).wait();
  return y;
}

at::Tensor reduce_scatter(const StepContext& c, const at::Tensor& x) {
  const int64_t d = c.step.tensor_dim;
  const int64_t length = x.size(d);
  at::Tensor moved = x.movedim(d, 0);
  const int64_t rows = chunk_span(length, c.ranks, 0).size;
  std::vector<int64_t> packed_shape = moved.sizes().vec();
  packed_shape[0] = rows * c.ranks;
  at::Tensor packed;
  if (rows * c.ranks == length) {
    packed = moved.contiguous();
  } else {
    packed = at::zeros(packed_shape, x.options());
    for (int64_t j = 0; j < c.ranks; ++j) {
      Span s = chunk_span(length, c.ranks, j);
      packed.narrow(0, j * rows, s.size).copy_(moved.narrow(0, s.offset, s.size));
    }
  }
  packed_shape[0] = rows;
  at::Tensor out = at::empty(packed_shape, x.options());
  dist::reduce_scatter(c.group, out, packed, c.step.op).wait();
  return out.narrow(0, 0, chunk_span(length, c.ranks, c.me).size).movedim(0, d).contiguous();
}

at::Tensor all_to_all(const StepContext& c, const at::Tensor& x) {
  const int64_t d1 = c.step.tensor_dim, d2 = c.step.to_tensor_dim;
  // Pieces of d1 each member holds now, and the split of d2 they will hold.
  std::vector<int64_t> a(c.ranks), b(c.ranks);
  const int64_t length2 = x.size(d2);
  for (int64_t j = 0; j < c.ranks; ++j) {
    a[j] = member_size(c, c.step.before, d1, j);
    b[j] = chunk_span(length2, c.ranks, j).size;
  }
  const int64_t A = *std::max_element(a.begin(), a.end());
  const int64_t B = *std::max_element(b.begin(), b.end());
  at::Tensor moved = x.movedim({d1, d2}, {0, 1});  // [a_me, length2, rest...]
  std::vector<int64_t> block = moved.sizes().vec();
  block[0] = A;
  block[1] = B;
  std::vector<int64_t> send_shape = block;
  send_shape.insert(send_shape.begin(), c.ranks);
  at::Tensor send = at::zeros(send_shape, x.options());
  for (int64_t j = 0; j < c.ranks; ++j) {
    Span s = chunk_span(length2, c.ranks, j);
    send[j].narrow(0, 0, moved.size(0)).narrow(1, 0, s.size).copy_(moved.narrow(1, s.offset, s.size));
  }
  at::Tensor recv = at::empty_like(send);
  dist::all_to_all(c.group, recv, send).wait();
  std::vector<at::Tensor> parts;
  for (int64_t j = 0; j < c.ranks; ++j) parts.push_back(recv[j].narrow(0, 0, a[j]).narrow(1, 0, b[c.me]));
  return at::cat(parts, 0).movedim({0, 1}, {d1, d2}).contiguous();
}

// Strided shards need every block to split evenly: the pieces are then
// equal and the interleaving is a reshape.
void check_strided_even(const StepContext& c) {
  const int64_t length = c.global_shape.at(c.step.tensor_dim);
  const int64_t k = c.step.split_factor;
  HP_CHECK_ARG(length % (k * c.ranks) == 0, "StridedShard(", c.step.tensor_dim, ", ", k,
               "): tensor dim ", c.step.tensor_dim, " of size ", length, " does not split into ",
               k, " blocks of ", c.ranks, " equal pieces; expected a size divisible by ",
               k * c.ranks);
}

at::Tensor strided_all_gather(const StepContext& c, const at::Tensor& x) {
  check_strided_even(c);
  const int64_t d = c.step.tensor_dim, k = c.step.split_factor;
  at::Tensor piece = x.movedim(d, 0).contiguous();  // [k * p, rest...]
  std::vector<int64_t> shape = piece.sizes().vec();
  const int64_t p = shape[0] / k;
  shape[0] *= c.ranks;
  at::Tensor gathered = at::empty(shape, x.options());  // [ranks * k * p, rest...]
  dist::all_gather_into(c.group, gathered, piece).wait();
  std::vector<int64_t> blocks = piece.sizes().vec();
  blocks[0] = p;
  blocks.insert(blocks.begin(), {c.ranks, k});           // [ranks, k, p, rest...]
  std::vector<int64_t> whole = piece.sizes().vec();
  whole[0] = c.ranks * k * p;
  return gathered.view(blocks).transpose(0, 1).reshape(whole).movedim(0, d).contiguous();
}

at::Tensor strided_chunk(const StepContext& c, const at::Tensor& x) {
  check_strided_even(c);
  const int64_t d = c.step.tensor_dim, k = c.step.split_factor;
  at::Tensor moved = x.movedim(d, 0);
  std::vector<int64_t> blocks = moved.sizes().vec();
  const int64_t length = blocks[0];
  blocks[0] = length / k;
  blocks.insert(blocks.begin(), k);                      // [k, length / k, rest...]
  const int64_t p = length / k / c.ranks;
  std::vector<int64_t> mine = moved.sizes().vec();
  mine[0] = k * p;
  return moved.reshape(blocks).narrow(1, c.me * p, p).reshape(mine).movedim(0, d).contiguous();
}

at::Tensor partition(const StepContext& c, const at::Tensor& x) {
  return partition_keeps_value(c.step.op, c.me) ? x.clone(at::MemoryFormat::Contiguous)
                                                 : at::zeros_like(x, at::MemoryFormat::Contiguous);
}

}  // namespace

at::Tensor execute_redistribute(const RedistributePlan& plan, const at::Tensor& local,
                                const DeviceMesh& mesh, const std::vector<int64_t>& global_shape) {
  at::Tensor x = local;
  for (const RedistributeStep& step : plan.steps()) {
    dist::Group& group = mesh.group(step.mesh_dim);
    StepContext c{step, mesh, global_shape, group, group.size(),
                  mesh.coordinate(step.mesh_dim)};
    switch (step.kind) {
      case Kind::kAllGather: x = all_gather(c, x); break;
      case Kind::kChunk: x = chunk(c, x); break;
      case Kind::kAllReduce: x = all_reduce(c, x); break;
      case Kind::kReduceScatter: x = reduce_scatter(c, x); break;
      case Kind::kAllToAll: x = all_to_all(c, x); break;
      case Kind::kPartition: x = partition(c, x); break;
      case Kind::kStridedAllGather: x = strided_all_gather(c, x); break;
      case Kind::kStridedChunk: x = strided_chunk(c, x); break;
    }
  }
  // An empty plan still hands back a tensor of its own.
  return x.is_same(local) ? local.detach() : x;
}

at::Tensor redistribute_local(const at::Tensor& local, const Layout& from, const Layout& to,
                              const std::vector<int64_t>& global_shape) {
  if (from == to) return local;
  auto plan = plan_redistribute(from.spec(), to.spec());
  at::NoGradGuard no_grad;
  return execute_redistribute(*plan, local, *to.mesh(), global_shape);
}

}  // namespace hp
