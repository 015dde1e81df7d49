// How one mesh dim holds a tensor (T1): Shard(dim) splits tensor dim
// `dim` across the mesh dim's ranks (torch.chunk semantics);
// StridedShard(dim, k) views the dim as k equal blocks and gives each rank
// its piece of every block (a fused [q; k; v] weight split so that each rank
// holds the q, k and v of its own heads; the blocks must divide evenly by
// the ranks); Replicate()
// gives every rank the whole tensor, Partial(op) means the tensor is the
// `op`-reduction of the ranks' local values (sum, avg, max or min).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/distributed/reduce_op.h"

namespace hp {

class Placement {
 public:
  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim, dist::ReduceOp::kSum); }
  static Placement strided_shard(int64_t dim, int64_t split_factor) {
    Placement p(Kind::kStridedShard, dim, dist::ReduceOp::kSum);
    p.split_factor_ = split_factor;
    return p;
  }
  static Placement replicate() { return Placement(Kind::kReplicate, 0, dist::ReduceOp::kSum); }
  static Placement partial(dist::ReduceOp op = dist::ReduceOp::kSum) {
    return Placement(Kind::kPartial, 0, op);
  }

  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int64_t dim) const { return is_shard() && dim_ == dim; }
  // A StridedShard is not is_shard(): code that knows only plain shards
  // must not take it for one.
  bool is_strided_shard() const { return kind_ == Kind::kStridedShard; }
  bool is_strided_shard(int64_t dim) const { return is_strided_shard() && dim_ == dim; }
  // Either kind of shard.
  bool is_sharded() const { return is_shard() || is_strided_shard(); }
  // Blocks of a StridedShard; 1 for a plain Shard.
  int64_t split_factor() const { return split_factor_; }
  // The same kind of shard on another tensor dim.
  Placement with_dim(int64_t dim) const {
    Placement p = *this;
    p.dim_ = dim;
    return p;
  }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  bool is_partial() const { return kind_ == Kind::kPartial; }
  // The sharded tensor dim (meaningful for Shard only; may be negative until
  // a layout is normalised against a tensor's ndim).
  int64_t dim() const { return dim_; }
  dist::ReduceOp reduce_op() const { return op_; }

  // "S(0)", "R", "P(sum)".
  std::string str() const;

  bool operator==(const Placement& o) const {
    return kind_ == o.kind_ && (kind_ != Kind::kShard || dim_ == o.dim_) &&
           (kind_ != Kind::kStridedShard || (dim_ == o.dim_ && split_factor_ == o.split_factor_)) &&
           (kind_ != Kind::kPartial || op_ == o.op_);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }

 private:
  enum class Kind : uint8_t { kShard, kReplicate, kPartial, kStridedShard };
  Placement(Kind kind, int64_t dim, dist::ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int64_t dim_;
  dist::ReduceOp op_;
  int64_t split_factor_ = 1;
};

using Placements = std::vector<Placement>;

// torch-style spellings: hp::Shard(0), hp::Replicate(), hp::Partial("avg").
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement StridedShard(int64_t dim, int64_t split_factor) {
  return Placement::strided_shard(dim, split_factor);
}
Placement Partial(const std::string& reduce_op = "sum");

// "[S(0), R]".
std::string to_string(const Placements& placements);

// The library's one convention for splitting a whole value into Partial(op)
// pieces (distribute_tensor and a redistribute's R -> P step must agree, or
// the same layout would hold different data depending on how it was made):
// for sum the rank at coordinate 0 along the mesh dim keeps the value and the
// others hold zeros; for avg, max and min every rank keeps it. Returns
// whether the rank at `coordinate` keeps the value.
inline bool partition_keeps_value(dist::ReduceOp op, int64_t coordinate) {
  return op != dist::ReduceOp::kSum || coordinate == 0;
}

}  // namespace hp
