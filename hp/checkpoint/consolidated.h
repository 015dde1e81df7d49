// Consolidated weights (C3 in docs/features.md): one safetensors file of
// whole tensors, which PyTorch, Python's safetensors package and
// `hp-train --init-from` read, exported from a state laid out on any mesh
// and imported into one laid out on any other.
#pragma once

#include <string>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/state.h"

namespace hp::checkpoint {

// Writes every tensor of `state` whose key starts with `prefix`, whole,
// named by its key without the prefix (export(state, "w.safetensors",
// "model.") gives GPT-2's names), in the state's order. Collective: the
// tensors are gathered one at a time and rank 0 writes each as it comes, so
// no rank holds more than one whole tensor. Atomic as write_safetensors is.
// Returns the file's size. A key held by some ranks only (State::add_held_by)
// is refused (hp::ArgumentError on every rank): rank 0 gathers nothing from
// a pipeline stage's holders.
uint64_t export_consolidated(const State& state, const std::string& path,
                             const std::string& prefix = "");

// Fills every tensor of `state` (each key `prefix` + a name in the file)
// from such a file; each rank reads only the byte ranges of the tensors it
// needs. The checks and their errors are load()'s (keys, shapes, dtypes
// before anything changes; with strict, a tensor of the file the state lacks
// is an error). A consolidated file carries no checksums: its format checks
// (read_safetensors_index) are what protects it.
LoadResult import_consolidated(State& state, const std::string& path,
                               const std::string& prefix = "", bool strict = true);

}  // namespace hp::checkpoint
