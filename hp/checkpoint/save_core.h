// The two halves of every save (checkpoint.h's save and async_save.h's
// AsyncCheckpointer share them; nothing else does):
//
//   plan_save    on the caller's thread: checks the state on every rank
//                (agreed) and decides which pieces this rank writes.
//   write_save   prepares ROOT/.tmp-step-N, writes this rank's file from
//                the given pieces, exchanges the ranks' reports, and rank 0
//                writes metadata.json and commits (checkpoint.h's crash
//                safety). Sync save runs it at once on the live pieces;
//                AsyncCheckpointer on its thread, on snapshots of them.
//
// Both are collective over `group` (nullptr: the world's; else a group of
// every rank of the world, in order), agreed as checkpoint.h says.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/plan.h"
#include "hp/checkpoint/state.h"

namespace hp::dist {
class Group;
}

namespace hp::checkpoint {

// What a save needs of a state once planned: no tensor of it, so a plan
// outlives the State it came from.
struct SavePlan {
  struct Entry {
    std::string key;
    at::ScalarType dtype;
    std::vector<int64_t> shape;       // global
    std::vector<int64_t> local_sizes; // this rank's piece
    std::string layout;               // as metadata.json records it
    std::vector<PlannedChunk> chunks; // every rank's, with their writers
  };
  std::string root;
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  std::vector<Entry> entries;        // in state order
  std::vector<int64_t> owned_count;  // chunks each rank writes
  std::vector<size_t> owned;         // entries whose piece this rank writes, in order
};

// Checks `state`, `root` and `step` on every rank (hp::ArgumentError on
// every rank if one rank's input is bad) and plans the save. Touches no file.
SavePlan plan_save(const State& state, const std::string& root, int64_t step,
                   dist::Group* group);

// Writes the checkpoint `plan` describes. `pieces[i]` holds the data of
// entry plan.owned[i] with its local sizes (CPU or CUDA, any strides); it is
// read while the call runs. `start` is when the save began, for
// SaveResult::seconds.
SaveResult write_save(const SavePlan& plan, const std::vector<at::Tensor>& pieces,
                      const SaveOptions& options, dist::Group* group,
                      std::chrono::steady_clock::time_point start);

}  // namespace hp::checkpoint
