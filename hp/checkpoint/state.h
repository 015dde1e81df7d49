// What a checkpoint holds (C1, C2 in docs/features.md): named tensors, each
// given as this rank's piece of a global tensor plus the geometry that says
// which piece it is.
//
//   hp::checkpoint::State state;
//   state.add("model.wte.weight", dtensor);                  // a DTensor: its layout
//   state.add("model.lm_head.weight", local, layout, shape); // any laid-out tensor
//   state.add("train.step", step_tensor);                    // every rank holds it whole
//   state.add_held_by("h.4.attn.c_attn.weight", w, {1});      // only rank 1 holds it
//   state.declare_held_by("h.0.ln_1.weight", {64}, at::kFloat, {0});  // on the other ranks
//
// save() reads the pieces (a GPU piece through pinned host memory); load()
// writes into them in place, so the tensors given here must be the ones the
// model and optimizer use (parameters, optimizer state), not copies. A piece
// whose layout says ranks hold the same data (Replicate dims) is written
// once, by the lowest rank holding it.
// Pieces must be boxes of the global tensor: Shard and Replicate placements
// (Partial is refused; a tensor-form DTensor with a StridedShard is moved to
// the plain Shard of its dim when added, collectively, and moved back after
// a load). Adding checks what needs no communication (names, dtypes,
// placements);
// whether each rank's piece fits its layout is checked by save and load,
// collectively, before they touch a file or a tensor.
//
// Keys held by some ranks only (a pipeline stage's parameters; docs/
// design.md, "Pipeline checkpoints"): every rank still declares every key, in the same order,
// with its global shape and dtype, and names the global ranks that hold it
// whole (its holders). A holder adds its tensor (add_held_by), every other
// rank only declares the key (declare_held_by). So the ranks' states still
// agree key for key, who writes what stays arithmetic (the lowest holder
// writes the tensor, once), and a rank reads and writes only what it holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "hp/tensor/dtensor.h"
#include "hp/tensor/layout.h"

namespace hp::checkpoint {

struct StateEntry {
  std::string key;
  at::Tensor local;            // this rank's piece (contiguous or not; CPU or CUDA)
  std::vector<int64_t> shape;  // the global shape
  // How the mesh's ranks hold the tensor (Shard and Replicate placements);
  // undefined: every rank of the job (or of `holders`) holds the whole tensor.
  Layout layout;
  // The global ranks that hold the tensor whole, ascending; empty: every
  // rank of the job holds its piece (by `layout`).
  std::vector<int> holders;
  // Whether this rank holds a piece. False only for a key declared with
  // declare_held_by: `local` is then an empty placeholder of the dtype
  // (zero-sized, 0-d for a 0-d shape), which save and load never touch.
  bool held_here = true;
};

class State {
 public:
  // A tensor every rank holds whole (a one-process or data-parallel model's
  // parameter, a step counter); a tensor-form DTensor (dtensor_tensor.h:
  // a tensor-parallel parameter) is taken as its local shard and layout,
  // except that a StridedShard layout is saved as a plain Shard copy
  // (collective; copied back by load) so its pieces are boxes.
  void add(const std::string& key, const at::Tensor& whole);
  // A DTensor's local piece, laid out as the DTensor says (a StridedShard
  // as above).
  void add(const std::string& key, const DTensor& value);
  // `local` is this rank's piece of a tensor of `shape` laid out by `layout`.
  void add(const std::string& key, const at::Tensor& local, const Layout& layout,
           const std::vector<int64_t>& shape);

  // A tensor that only `holders` (global ranks; this one among them) hold,
  // each the whole of it: the tensor of a key the other ranks declare with
  // declare_held_by. The lowest holder writes it.
  void add_held_by(const std::string& key, const at::Tensor& whole, std::vector<int> holders);
  // A tensor of `shape` and `dtype` that `holders` (global ranks, not this
  // one) hold whole: this rank writes and reads nothing of it, but declares
  // it, so that every rank's state names every key of the checkpoint.
  void declare_held_by(const std::string& key, const std::vector<int64_t>& shape,
                       at::ScalarType dtype, std::vector<int> holders);

  // Called by load() on every rank after every tensor was filled, in the
  // order added: for values that live outside tensors (an optimizer's step
  // count, a training position), which the state holds as tensors and the
  // callback copies back.
  void on_loaded(std::function<void()> callback) { on_loaded_.push_back(std::move(callback)); }
  void run_on_loaded() const {
    for (const auto& callback : on_loaded_) callback();
  }

  const std::vector<StateEntry>& entries() const { return entries_; }
  // The entry named `key`, or nullptr.
  const StateEntry* find(const std::string& key) const;
  bool empty() const { return entries_.empty(); }
  // A checksum of every key, global shape, dtype, layout and holders, in
  // order: the ranks of a job must hold states with equal signatures.
  uint32_t signature() const;

 private:
  void add_entry(StateEntry entry);
  // `holders` sorted, unique, ranks of the job; checked against this rank.
  std::vector<int> checked_holders(const std::string& key, std::vector<int> holders,
                                   bool holds_it) const;
  // `local` as the 4-argument add(), but a StridedShard layout is moved to
  // the plain Shard of its dim and copied back after a load.
  void add_boxed(const std::string& key, const at::Tensor& local, const Layout& layout,
                 const std::vector<int64_t>& shape);

  std::vector<StateEntry> entries_;
  std::map<std::string, size_t> index_;
  std::vector<std::function<void()>> on_loaded_;
};

}  // namespace hp::checkpoint
