#include "hp/checkpoint/state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/distributed/world.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

#include <algorithm>

namespace hp::checkpoint {

void State::add(const std::string& key, const at::Tensor& whole) {
  HP_CHECK_ARG(whole.defined(), "checkpoint state: tensor '", key, "' is undefined");
  if (!is_dtensor(whole)) return add_entry({key, whole, whole.sizes().vec(), Layout()});
  // A tensor-form DTensor (a tensor-parallel parameter, its optimizer
  // state) is its local shard and layout. A StridedShard piece is not a box
  // of the global tensor, so it goes in moved to the plain Shard of its dim
  // (a collective: every rank adds the same keys in the same order) and
  // comes back into the strided piece after a load.
  add_boxed(key, local_of(whole), layout_of(whole), whole.sizes().vec());
}

void State::add(const std::string& key, const DTensor& value) {
  HP_CHECK_ARG(value.defined(), "checkpoint state: DTensor '", key, "' is undefined");
  add_boxed(key, value.local(), value.layout(), value.sizes());
}

void State::add_boxed(const std::string& key, const at::Tensor& local, const Layout& layout,
                      const std::vector<int64_t>& shape) {
  if (!layout.has_strided()) return add(key, local, layout, shape);
  at::NoGradGuard no_grad;
  FromLocalOptions options;
  options.shape = shape;
  const Layout plain = layout.without_strided(Layout::StridedAs::kPlainShard);
  at::Tensor piece = from_local(local, layout, options).redistribute(plain).local();
  add(key, piece, plain, shape);
  const at::Tensor target = local;
  on_loaded([piece, plain, layout, shape, target] {
    at::NoGradGuard no_grad;
    FromLocalOptions options;
    options.shape = shape;
    target.copy_(from_local(piece, plain, options).redistribute(layout).local());
  });
}

void State::add(const std::string& key, const at::Tensor& local, const Layout& layout,
                const std::vector<int64_t>& shape) {
  HP_CHECK_ARG(local.defined(), "checkpoint state: tensor '", key, "' is undefined");
  HP_CHECK_ARG(layout.defined(), "checkpoint state: tensor '", key,
               "' has an undefined layout; use add(key, tensor) for a tensor every rank holds");
  add_entry({key, local, shape, layout});
}

void State::add_held_by(const std::string& key, const at::Tensor& whole,
                        std::vector<int> holders) {
  HP_CHECK_ARG(whole.defined(), "checkpoint state: tensor '", key, "' is undefined");
  HP_CHECK_ARG(!is_dtensor(whole), "checkpoint state: tensor '", key,
               "' is a DTensor; a key held by some ranks only is held whole by each of them");
  StateEntry entry{key, whole, whole.sizes().vec(), Layout()};
  entry.holders = checked_holders(key, std::move(holders), /*holds_it=*/true);
  add_entry(std::move(entry));
}

void State::declare_held_by(const std::string& key, const std::vector<int64_t>& shape,
                            at::ScalarType dtype, std::vector<int> holders) {
  for (int64_t size : shape) {
    HP_CHECK_ARG(size >= 0, "checkpoint state: key '", key, "' is declared with shape ",
                 to_string(shape), "; sizes must be >= 0");
  }
  // Nothing of it lives here: a zero-sized placeholder that carries the
  // dtype and the number of dims (a 0-d one for a 0-d tensor).
  const std::vector<int64_t> empty(shape.size(), 0);
  StateEntry entry{key, at::empty(empty, at::TensorOptions().dtype(dtype)), shape, Layout()};
  entry.holders = checked_holders(key, std::move(holders), /*holds_it=*/false);
  entry.held_here = false;
  add_entry(std::move(entry));
}

std::vector<int> State::checked_holders(const std::string& key, std::vector<int> holders,
                                        bool holds_it) const {
  std::sort(holders.begin(), holders.end());
  holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
  const int rank = dist::is_initialized() ? dist::get_rank() : 0;
  const int size = dist::is_initialized() ? dist::get_world_size() : 1;
  HP_CHECK_ARG(!holders.empty(), "checkpoint state: key '", key,
               "' names no holder; name the global ranks that hold it");
  HP_CHECK_ARG(holders.front() >= 0 && holders.back() < size, "checkpoint state: key '", key,
               "' is held by ranks ", to_string(holders), ", which are not all ranks of this job of ",
               size);
  const bool here = std::binary_search(holders.begin(), holders.end(), rank);
  HP_CHECK_ARG(here == holds_it, "checkpoint state: key '", key, "' is held by ranks ",
               to_string(holders), ", ", here ? "this rank among them" : "not this rank",
               holds_it ? "; a rank that does not hold a key declares it (declare_held_by)"
                        : "; a rank that holds a key adds its tensor (add_held_by)",
               " (rank ", rank, ")");
  return holders;
}

uint32_t State::signature() const {
  std::string text;
  for (const StateEntry& e : entries_) {
    text += cat(e.key, '\n', to_string(e.shape), '\n', e.local.scalar_type(), '\n',
                e.layout.defined() ? e.layout.str() : std::string("whole"), '\n');
    // Only for keys held by some ranks: an ordinary state's signature is
    // what it was before holders existed.
    if (!e.holders.empty()) text += cat("held by ", to_string(e.holders), '\n');
  }
  return crc32c(0, text.data(), text.size());
}

const StateEntry* State::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void State::add_entry(StateEntry entry) {
  const std::string& key = entry.key;
  HP_CHECK_ARG(!key.empty(), "checkpoint state: keys must be non-empty");
  HP_CHECK_ARG(key != "__metadata__", "checkpoint state: '__metadata__' is reserved");
  HP_CHECK_ARG(!index_.count(key), "checkpoint state: key '", key,
               "' is added twice; keys must be unique");
  HP_CHECK_ARG(entry.local.is_cpu() || entry.local.is_cuda(), "checkpoint state: tensor '", key,
               "' is on ", entry.local.device(), "; checkpoints hold CPU and CUDA tensors");
  HP_CHECK_ARG(safetensors_dtype_name(entry.local.scalar_type()).has_value(),
               "checkpoint state: tensor '", key, "' has dtype ", entry.local.scalar_type(),
               ", which the checkpoint format cannot hold");
  HP_CHECK_ARG(entry.local.dim() == static_cast<int64_t>(entry.shape.size()),
               "checkpoint state: tensor '", key, "' has ", entry.local.dim(),
               " dims but its global shape ", to_string(entry.shape), " has ", entry.shape.size());
  if (entry.layout.defined()) {
    entry.layout = entry.layout.normalized(entry.local.dim());
    for (const Placement& p : entry.layout.placements()) {
      HP_CHECK_ARG(!p.is_strided_shard(), "checkpoint state: tensor '", key, "' has layout ",
                   entry.layout.str(),
                   "; checkpoints hold pieces that are boxes of the global tensor, and a "
                   "StridedShard piece is not: add the tensor-form DTensor itself (add(key, "
                   "tensor) moves it to a plain shard), or redistribute it first");
      HP_CHECK_ARG(!p.is_partial(), "checkpoint state: tensor '", key, "' has layout ",
                   entry.layout.str(),
                   "; a Partial value is not a tensor yet: redistribute it to Replicate or "
                   "Shard before saving");
    }
    HP_CHECK_ARG(entry.layout.mesh()->contains_self(), "checkpoint state: tensor '", key,
                 "' is laid out on ", entry.layout.mesh()->describe(),
                 ", which does not include this rank");
  }
  index_[key] = entries_.size();
  entries_.push_back(std::move(entry));
}

}  // namespace hp::checkpoint
