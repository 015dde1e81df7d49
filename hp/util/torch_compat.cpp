#include "hp/util/torch_compat.h"

#include <ATen/Context.h>
#include <ATen/Version.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
// A CUDA libtorch's CMake targets define USE_C10D_NCCL and bring the CUDA
// include directories this header needs.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <ATen/cuda/CUDAContext.h>
#endif

#include <cctype>

#include "hp/util/error.h"

namespace hp::compat {

const char* torch_version() { return TORCH_VERSION; }

c10::intrusive_ptr<c10d::ProcessGroup> gloo_process_group(
    const c10::intrusive_ptr<c10d::ProcessGroupGloo>& gloo,
    const c10::intrusive_ptr<c10d::Store>& store) {
#if HP_TORCH_AT_LEAST(2, 0)
  // What torch.distributed's new_group does for backend "gloo": one
  // ProcessGroup whose CPU and CUDA tensors both go to the Gloo backend
  // (ProcessGroupGloo runs CUDA tensors through pinned host copies).
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, gloo->getRank(), gloo->getSize());
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  if (at::hasCUDA()) {
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
  }
  return pg;
#else
  (void)store;
  return gloo;
#endif
}

std::string cpu_capability() {
#if HP_TORCH_AT_LEAST(2, 0)
  std::string name = at::get_cpu_capability();
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
#else
  return "";
#endif
}

bool has_nccl() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, c10::Device device) {
  require_cuda("an NCCL process group");
#if defined(USE_C10D_NCCL) && HP_TORCH_AT_LEAST(2, 0)
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBoundDeviceId(device);  // one device per rank: NCCL need not guess it
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  return pg;
#elif defined(USE_C10D_NCCL)
  // 1.x: ProcessGroupNCCL is itself a ProcessGroup and picks its device
  // from the tensors.
  (void)device;
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout, (void)device;
  throw_argument_error(cat("backend 'nccl' needs a libtorch built with NCCL (USE_C10D_NCCL); "
                           "this libtorch ", TORCH_VERSION,
                           " has none: use HP_CUDA_BACKEND=gloo for CUDA tensors, or 'cpu'"));
#endif
}

int cuda_device_count() {
  if (!at::hasCUDA()) return 0;
  return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount());
}

bool cuda_available() { return cuda_device_count() > 0; }

void require_cuda(const std::string& what) {
#ifdef USE_C10D_NCCL
  // A CUDA libtorch (the CUDA wheel on a machine without a GPU): at::hasCUDA
  // is false without a driver and a device, not only without CUDA.
  HP_CHECK_ARG(at::hasCUDA(), what, " needs a CUDA device; this libtorch ", TORCH_VERSION,
               " has CUDA but finds no GPU (none here, or no driver: nvidia-smi, "
               "CUDA_VISIBLE_DEVICES): use device 'cpu'");
#else
  HP_CHECK_ARG(at::hasCUDA(), what, " needs a libtorch built with CUDA; this libtorch ",
               TORCH_VERSION, " is CPU-only: use device 'cpu'");
#endif
  HP_CHECK_ARG(cuda_device_count() > 0, what, " needs a CUDA device; this libtorch ",
               TORCH_VERSION, " has CUDA but sees no device (CUDA_VISIBLE_DEVICES, driver)");
}

void require_cuda_device(int index, const std::string& what) {
  require_cuda(what);
  HP_CHECK_ARG(index >= 0 && index < cuda_device_count(), what, ": CUDA device index ", index,
               " is out of range for ", cuda_device_count(), " device(s)");
}

c10::Device set_current_cuda_device(int index) {
  require_cuda_device(index, "device 'cuda'");
  c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(device);
  return device;
}

std::string cuda_device_name(int index) {
  require_cuda_device(index, "cuda_device_name");
#ifdef USE_C10D_NCCL
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->name;
#else
  HP_CHECK_ARG(false, "cuda_device_name: this build of the project has no CUDA runtime headers "
               "(libtorch ", TORCH_VERSION, " without NCCL)");
  return "";
#endif
}

}  // namespace hp::compat
