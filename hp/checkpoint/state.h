// What a checkpoint holds (C1, C2 in docs/features.md): named tensors, each
// given as this rank's piece of a global tensor plus the geometry that says
// which piece it is.
//
//   hp::checkpoint::State state;
//   state.add("model.wte.weight", dtensor);                  // a DTensor: its layout
//   state.add("model.lm_head.weight", local, layout, shape); // any laid-out tensor
//   state.add("train.step", step_tensor);                    // every rank holds it whole
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
  // undefined: every rank of the job holds the whole tensor.
  Layout layout;
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
  // A checksum of every key, global shape, dtype and layout, in order: the
  // ranks of a job must hold states with equal signatures.
  uint32_t signature() const;

 private:
  void add_entry(StateEntry entry);
  // `local` as the 4-argument add(), but a StridedShard layout is moved to
  // the plain Shard of its dim and copied back after a load.
  void add_boxed(const std::string& key, const at::Tensor& local, const Layout& layout,
                 const std::vector<int64_t>& shape);

  std::vector<StateEntry> entries_;
  std::map<std::string, size_t> index_;
  std::vector<std::function<void()>> on_loaded_;
};

}  // namespace hp::checkpoint
