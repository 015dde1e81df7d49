#include "hp/tensor/placement.h"

#include "hp/util/format.h"

namespace hp {

std::string Placement::str() const {
  switch (kind_) {
    case Kind::kShard: return cat("S(", dim_, ")");
    case Kind::kReplicate: return "R";
    case Kind::kPartial: return cat("P(", dist::to_string(op_), ")");
    case Kind::kStridedShard: return cat("S(", dim_, ", split ", split_factor_, ")");
  }
  return "?";
}

Placement Partial(const std::string& reduce_op) {
  return Placement::partial(dist::parse_reduce_op(reduce_op, "Partial reduce_op"));
}

std::string to_string(const Placements& placements) {
  std::string out = "[";
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i) out += ", ";
    out += placements[i].str();
  }
  return out + "]";
}

}  // namespace hp
