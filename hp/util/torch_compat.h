// The one place that knows which libtorch the project is built against.
//
// Supported: Debian's libtorch 1.13 (CPU, Gloo) and libtorch 2.x (CPU or
// CUDA; tested with 2.11). Everything that differs between them is behind
// this header, so no other file tests a version:
//   - c10::Allocator: allocate() lost its const in 2.x and copy_data() became
//     a pure virtual; CountingAllocatorBase takes both shapes.
//   - c10d: in 1.13 ProcessGroupGloo is a c10d::ProcessGroup; in 2.x it is a
//     c10d::Backend that a ProcessGroup dispatches to per device type;
//     wrap_backend() gives a ProcessGroup either way.
//   - torch::optim::Optimizer::state() is keyed by the parameter's
//     TensorImpl as a string in 1.13 and as a pointer in 2.x;
//     optimizer_state_key() gives the key either way.
//   - autograd::Node is owned through std::shared_ptr (deleter deleteNode)
//     up to 2.12 and through c10::intrusive_ptr from 2.13;
//     AutogradNodePtr, make_autograd_node() and weak_autograd_node() hide it.
//   - CUDA and NCCL are optional in both: the helpers below raise an
//     ArgumentError naming what this build lacks instead of failing later.
#pragma once

#include <torch/version.h>

#include <ATen/core/TensorBase.h>
#include <c10/core/Allocator.h>
#include <c10/util/C++17.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

namespace c10d {
class Store;
class ProcessGroup;
class ProcessGroupGloo;
}  // namespace c10d

#define HP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace torch::autograd {
struct Node;
#if !HP_TORCH_AT_LEAST(2, 13)
// Declared in <torch/csrc/autograd/function.h>; repeated here so that this
// header stays light.
void deleteNode(Node* function);
#endif
}  // namespace torch::autograd

namespace hp::compat {

// An owning pointer to an autograd node, in the form this libtorch uses
// (Tensor::grad_fn(), impl::grad_accumulator() and set_history() take it).
#if HP_TORCH_AT_LEAST(2, 13)
template <class NodeT = torch::autograd::Node>
using AutogradNodePtr = c10::intrusive_ptr<NodeT>;

template <class NodeT>
AutogradNodePtr<NodeT> make_autograd_node() {
  return c10::make_intrusive<NodeT>();
}

// What impl::set_grad_accumulator() keeps: a non-owning reference. (A
// template, so that Node need only be complete where it is called.)
template <class NodeT = torch::autograd::Node>
c10::weak_intrusive_ptr<NodeT> weak_autograd_node(const AutogradNodePtr<NodeT>& node) {
  return c10::weak_intrusive_ptr<NodeT>(node);
}
#else
template <class NodeT = torch::autograd::Node>
using AutogradNodePtr = std::shared_ptr<NodeT>;

template <class NodeT>
AutogradNodePtr<NodeT> make_autograd_node() {
  // deleteNode frees long chains of nodes without deep recursion.
  return AutogradNodePtr<NodeT>(new NodeT(), torch::autograd::deleteNode);
}

template <class NodeT = torch::autograd::Node>
std::weak_ptr<NodeT> weak_autograd_node(const AutogradNodePtr<NodeT>& node) {
  return node;
}
#endif

// "1.13.0", "2.11.0": the libtorch headers this was compiled with.
const char* torch_version();

// The key of `param`'s entry in torch::optim::Optimizer::state().
#if HP_TORCH_AT_LEAST(2, 0)
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::TensorBase& param) {
  return param.unsafeGetTensorImpl();
}
#else
using OptimizerStateKey = std::string;
inline OptimizerStateKey optimizer_state_key(const at::TensorBase& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}
#endif

// Base of an allocator that hands out host memory (memcpy-copyable).
// Subclasses implement allocate_bytes(); the version's allocate() and, in
// 2.x, copy_data() are defined here.
class CountingAllocatorBase : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(std::size_t nbytes) const = 0;
#if HP_TORCH_AT_LEAST(2, 0)
  c10::DataPtr allocate(std::size_t nbytes) override { return allocate_bytes(nbytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(std::size_t nbytes) const override { return allocate_bytes(nbytes); }
#endif
};

// The ProcessGroup that runs collectives on `gloo` (made over `store`). In
// 1.13 that is `gloo` itself; in 2.x a ProcessGroup that dispatches CPU and,
// on a CUDA build, CUDA tensors to it.
c10::intrusive_ptr<c10d::ProcessGroup> gloo_process_group(
    const c10::intrusive_ptr<c10d::ProcessGroupGloo>& gloo,
    const c10::intrusive_ptr<c10d::Store>& store);

// An NCCL process group bound to `device` (a CUDA device). Raises
// ArgumentError on a build without NCCL (USE_C10D_NCCL) or without CUDA.
c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, c10::Device device);

// The CPU kernels ATen dispatches to, in lower case ("avx512", "avx2",
// "default": what ATEN_CPU_CAPABILITY may force), or "" where this libtorch
// does not say (1.13).
std::string cpu_capability();

// Whether this libtorch was built with NCCL support in c10d.
bool has_nccl();

// Whether c10d's Gloo backend gathers into one flat tensor (_allgather_base)
// for CPU tensors: 1.13's raises that it cannot; 2.15's can (checked in its
// ProcessGroupGloo.hpp and run). Versions in between are not assumed to.
// (2.15's Gloo reduce-scatter from one flat tensor returns a Work without a
// future, which asynchronous completion needs: not used.)
constexpr bool gloo_has_flat_all_gather() { return HP_TORCH_AT_LEAST(2, 15); }

// Whether this libtorch has CUDA and sees at least one device.
bool cuda_available();
int cuda_device_count();
// Raises ArgumentError naming `what` needs CUDA when !cuda_available().
void require_cuda(const std::string& what);
// require_cuda, then ArgumentError naming `what` when `index` is not one of
// the visible devices.
void require_cuda_device(int index, const std::string& what);
// Makes CUDA device `index` the calling thread's current device and returns
// it (which index a rank uses is hp::dist::local_cuda_index's choice).
c10::Device set_current_cuda_device(int index);
// The name CUDA gives device `index` ("NVIDIA H100 80GB HBM3"). Raises as
// require_cuda does, and names a build without the CUDA runtime's headers.
std::string cuda_device_name(int index);

}  // namespace hp::compat
