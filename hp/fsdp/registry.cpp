#include "hp/fsdp/registry.h"

#include <mutex>
#include <unordered_map>

namespace hp::fsdp {
namespace {

struct Entry {
  std::weak_ptr<Unit> unit;
  FSDPParam* param;
};

std::mutex g_mutex;
std::unordered_map<const c10::TensorImpl*, Entry>& entries() {
  static auto* map = new std::unordered_map<const c10::TensorImpl*, Entry>();
  return *map;
}

}  // namespace

void register_param(const at::Tensor& param, const std::shared_ptr<Unit>& unit,
                    FSDPParam* managed) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries()[param.unsafeGetTensorImpl()] = {unit, managed};
}

std::optional<ManagedParam> find_managed(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = entries().find(param.unsafeGetTensorImpl());
  if (it == entries().end()) return std::nullopt;
  auto unit = it->second.unit.lock();
  if (!unit) {
    entries().erase(it);
    return std::nullopt;
  }
  return ManagedParam{std::move(unit), it->second.param};
}

void unregister_param(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_mutex);
  entries().erase(param.unsafeGetTensorImpl());
}

}  // namespace hp::fsdp
