// The process world: rendezvous, the world group and sub-groups.
//
// init_process_group() reads the launcher's environment (launch_env.h),
// meets the other ranks at a TCPStore on MASTER_ADDR:MASTER_PORT (rank 0
// hosts it) and builds the world's Gloo process group. Sub-groups are made
// collectively, as in torch.distributed: every rank of the world calls
// new_group() with the same arguments in the same order (non-members get a
// non-member Group back); groups are cached by (ranks, tag), so asking twice
// returns the same group. A different tag gives a separate process group over
// the same ranks: collectives on two groups run independently, which the
// layers above use as communication "streams".
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "hp/distributed/group.h"
#include "hp/distributed/launch_env.h"

namespace hp::dist {

struct InitOptions {
  // Applies to the rendezvous and to every collective (0 = the default:
  // HP_TIMEOUT_S from the environment, else 300 s).
  std::chrono::milliseconds timeout{0};
  // Backend worker threads per process group. Collectives on one group
  // serialise anyway; a second thread only adds hand-offs (on this machine a
  // 4-rank all-gather of 4 bytes took ~4 ms with 2 threads, ~2 ms with 1).
  // Overlap comes from separate groups (tags), each with its own thread.
  int threads = 1;
};

struct GroupOptions {
  std::string tag;
  // 0 = the world's timeout.
  std::chrono::milliseconds timeout{0};
  // kNccl: an NCCL group on this rank's GPU (LOCAL_RANK % device count), for
  // CUDA tensors; it needs a libtorch with CUDA and NCCL and raises an
  // ArgumentError naming what is missing otherwise. Groups are cached per
  // backend: the same ranks and tag on Gloo and on NCCL are two groups.
  BackendType backend = BackendType::kGloo;
};

// Also sets SIGPIPE to be ignored in this process (see world.cpp).
void init_process_group(const InitOptions& options = {});
bool is_initialized();
// Drops every group; a later init_process_group() starts afresh.
void destroy_process_group();

int get_rank();
int get_world_size();
const LaunchEnv& launch_env();
// This rank's GPU (local_cuda_index of launch_env()), made the calling
// thread's current device. Raises ArgumentError without CUDA.
c10::Device local_cuda_device();

GroupPtr world_group();
GroupPtr new_group(const std::vector<int>& ranks, const GroupOptions& options = {});

}  // namespace hp::dist
