#include "hp/checkpoint/state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "hp/checkpoint/crc32c.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

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

uint32_t State::signature() const {
  std::string text;
  for (const StateEntry& e : entries_) {
    text += cat(e.key, '\n', to_string(e.shape), '\n', e.local.scalar_type(), '\n',
                e.layout.defined() ? e.layout.str() : std::string("whole"), '\n');
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
