// How one mesh dim holds a tensor (T1): Shard(dim) splits tensor dim
// `dim` across the mesh dim's ranks (torch.chunk semantics), Replicate()
// gives every rank the whole tensor, Partial(op) means the tensor is the
// `op`-reduction of the ranks' local values (sum, avg, max or min).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/dist/reduce_op.h"

namespace hp {

class Placement {
 public:
  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim, dist::ReduceOp::kSum); }
  static Placement replicate() { return Placement(Kind::kReplicate, 0, dist::ReduceOp::kSum); }
  static Placement partial(dist::ReduceOp op = dist::ReduceOp::kSum) {
    return Placement(Kind::kPartial, 0, op);
  }

  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int64_t dim) const { return is_shard() && dim_ == dim; }
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
           (kind_ != Kind::kPartial || op_ == o.op_);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }

 private:
  enum class Kind : uint8_t { kShard, kReplicate, kPartial };
  Placement(Kind kind, int64_t dim, dist::ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int64_t dim_;
  dist::ReduceOp op_;
};

using Placements = std::vector<Placement>;

// torch-style spellings: hp::Shard(0), hp::Replicate(), hp::Partial("avg").
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
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
