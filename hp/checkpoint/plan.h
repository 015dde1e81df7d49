// Which rank writes which chunk, and which saved bytes a rank reads back
// (C1, C2 in docs/features.md). Pure arithmetic on layouts: every rank
// computes the same plan on its own, so saving needs no communication to
// decide who writes what.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "hp/checkpoint/state.h"

namespace hp::checkpoint {

// A box of a global tensor: per dim an offset and a size.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
};

// The part both boxes cover, if any element.
std::optional<Box> intersect(const Box& a, const Box& b);

// The box of `entry` this rank holds (the whole tensor for an entry without
// a layout; zero sizes for a key this rank only declares, which holds
// nothing even when 0-d: look at StateEntry::held_here).
Box local_box(const StateEntry& entry);

struct PlannedChunk {
  Box box;
  int writer;  // global rank
};

// Every distinct non-empty box the ranks hold, each with the lowest global
// rank holding it, which writes it: a box held by several ranks (Replicate
// dims, or an entry without a layout, which every rank holds: rank 0 writes
// it; or its holders: the lowest of them) is written once. In mesh order.
std::vector<PlannedChunk> plan_chunks(const StateEntry& entry);

// `part` of `box`'s data, where `data` holds exactly `box` (row-major): a
// view, offsets taken relative to the box.
at::Tensor view_of(const at::Tensor& data, const Box& box, const Box& part);

}  // namespace hp::checkpoint
