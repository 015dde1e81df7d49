#include "hp/distributed/world.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <cstdlib>
#include <map>
#include <mutex>
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include <unistd.h>

#include "hp/distributed/shm_channel.h"
#include "hp/util/env.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp::dist {
namespace {

struct World {
  LaunchEnv env;
  std::chrono::milliseconds timeout{0};
  int threads = 1;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
  GroupPtr world;
  std::map<std::tuple<std::vector<int>, std::string, BackendType>, GroupPtr> groups;
};

std::mutex g_mutex;
std::unique_ptr<World> g_world;

World& the_world() {
  HP_CHECK_ARG(g_world != nullptr,
               "the process group is not initialized; call hp::dist::init_process_group() first");
  return *g_world;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// The transport every group of this process uses. Local jobs stay on
// loopback; multi-node jobs bind to GLOO_SOCKET_IFNAME when given (as
// torch.distributed does), else to HP_GLOO_HOST, else to this host's name.
std::shared_ptr<::gloo::transport::Device> make_device(const LaunchEnv& env) {
  if (auto ifname = hp::env::get("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  }
  if (auto host = hp::env::get("HP_GLOO_HOST")) {
    return c10d::ProcessGroupGloo::createDeviceForHostname(*host);
  }
  if (is_loopback(env.master_addr)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::string group_name(const World& w, const std::vector<int>& ranks, const std::string& tag,
                       BackendType backend) {
  bool whole_world = static_cast<int>(ranks.size()) == w.env.world_size;
  for (size_t i = 0; whole_world && i < ranks.size(); ++i) whole_world = ranks[i] == int(i);
  std::string base = whole_world ? "world" : cat("group", to_string(ranks));
  if (backend == BackendType::kNccl) base += "@nccl";
  return tag.empty() ? base : cat(base, "#", tag);
}

GroupPtr make_group(World& w, const std::vector<int>& ranks, const std::string& tag,
                    std::chrono::milliseconds timeout, BackendType backend) {
  std::string name = group_name(w, ranks, tag, backend);
  int group_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == w.env.rank) group_rank = static_cast<int>(i);
  }
  // Every rank checks, members or not, before anyone connects.
  std::optional<c10::Device> cuda_device;
  if (backend == BackendType::kNccl) {
    HP_CHECK_ARG(compat::has_nccl(), "new_group: backend 'nccl' needs a libtorch built with NCCL; "
                 "this libtorch ", compat::torch_version(), " has none (use backend 'gloo', "
                 "which also carries CUDA tensors on a CUDA build)");
    cuda_device = compat::set_current_cuda_device(
        local_cuda_index(w.env, compat::cuda_device_count()));
  }
  if (group_rank < 0) {
    return std::make_shared<Group>(ranks, -1, nullptr, name, timeout, backend,
                                   cuda_device.value_or(c10::Device(c10::DeviceType::CPU)));
  }
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::unique_ptr<ShmChannel> shm;
  try {
    // A group of one has no peer to meet: it rendezvouses in a local store,
    // so it never depends on rank 0's TCPStore still being there.
    c10::intrusive_ptr<c10d::Store> base = w.store;
    if (ranks.size() == 1) base = c10::make_intrusive<c10d::HashStore>();
    auto store = c10::make_intrusive<c10d::PrefixStore>("hp/" + name, base);
    const int size = static_cast<int>(ranks.size());
    if (backend == BackendType::kNccl) {
      pg = compat::make_nccl_group(store, group_rank, size, timeout, *cuda_device);
    } else {
      auto options = c10d::ProcessGroupGloo::Options::create(timeout);
      options->devices.push_back(w.device);
      options->threads = w.threads;
      pg = compat::gloo_process_group(
          c10::make_intrusive<c10d::ProcessGroupGloo>(store, group_rank, size, options), store);
      // Members on one host also share memory for the bulk CPU collectives.
      if (size > 1) {
        shm = ShmChannel::connect(*store, group_rank, size, timeout,
                                  cat("group '", name, "' ranks ", to_string(ranks)));
      }
    }
    // Members leave only once all of them are connected (torch.distributed
    // does the same with a store barrier): a rank that finished early must
    // not exit and take the store (hosted by rank 0) from a peer that is
    // still looking up addresses in it.
    if (ranks.size() > 1) pg->barrier()->wait();
  } catch (const std::exception& e) {
    throw CollectiveError(cat("creating process group '", name, "' ranks ", to_string(ranks),
                              " failed on rank ", w.env.rank, " (timeout ", timeout.count(),
                              " ms): ", exception_message(e)));
  }
  // c10d objects are intrusively counted; the deleter keeps one reference.
  std::shared_ptr<c10d::ProcessGroup> process_group(
      pg.get(), [pg](c10d::ProcessGroup*) mutable { pg.reset(); });
  return std::make_shared<Group>(ranks, group_rank, std::move(process_group), name, timeout,
                                 backend, cuda_device.value_or(c10::Device(c10::DeviceType::CPU)),
                                 std::move(shm));
}

// HP_TIMEOUT_S, else 300 s. At least 1 ms, since c10d reads a timeout of 0
// ms ("0.0001" truncated) as "wait forever"; at most a year, and finite
// ("inf" cast to milliseconds was negative).
std::chrono::milliseconds default_timeout() {
  if (auto seconds = hp::env::get_seconds("HP_TIMEOUT_S", 0.001, 365.0 * 24 * 3600)) {
    return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(*seconds * 1000)));
  }
  return std::chrono::seconds(300);
}

}  // namespace

void init_process_group(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  // A peer that dies closes its sockets; Gloo's next write to one would
  // raise SIGPIPE and kill this process without a word. Ignored, the write
  // fails and the collective raises a CollectiveError that says what
  // happened (Python, and so torch.distributed, ignores SIGPIPE too).
  std::signal(SIGPIPE, SIG_IGN);
  HP_CHECK_ARG(g_world == nullptr,
               "init_process_group: the process group is already initialized; call "
               "destroy_process_group() first");
  HP_CHECK_ARG(options.threads >= 1, "InitOptions.threads must be >= 1, got ", options.threads);
  HP_CHECK_ARG(options.timeout.count() >= 0, "InitOptions.timeout must be >= 0 ms, got ",
               options.timeout.count());
  auto w = std::make_unique<World>();
  w->env = read_launch_env();
  // Before any NCCL communicator exists: NCCL reads these when it first
  // initialises (launch_env.h says why ranks sharing a GPU need them).
  if (compat::has_nccl()) {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    for (const auto& [name, value] :
         nccl_env_for_shared_gpus(w->env, compat::cuda_device_count(), host)) {
      ::setenv(name.c_str(), value.c_str(), /*overwrite=*/0);
    }
  }
  w->timeout = options.timeout.count() > 0 ? options.timeout : default_timeout();
  w->threads = options.threads;

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(w->env.master_port);
  store_options.isServer = w->env.rank == 0;
  store_options.numWorkers = static_cast<size_t>(w->env.world_size);
  store_options.waitWorkers = true;
  store_options.timeout = w->timeout;
  try {
    w->store = c10::make_intrusive<c10d::TCPStore>(w->env.master_addr, store_options);
  } catch (const std::exception& e) {
    throw CollectiveError(cat("init_process_group: rendezvous at ", w->env.master_addr, ":",
                              w->env.master_port, " failed for rank ", w->env.rank, " of ",
                              w->env.world_size, " (timeout ", w->timeout.count(),
                              " ms): ", exception_message(e)));
  }
  w->device = make_device(w->env);
  std::vector<int> all(w->env.world_size);
  for (int r = 0; r < w->env.world_size; ++r) all[r] = r;
  w->world = make_group(*w, all, "", w->timeout, BackendType::kGloo);
  w->groups[{all, "", BackendType::kGloo}] = w->world;
  g_world = std::move(w);
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_world != nullptr;
}

void destroy_process_group() {
  std::unique_ptr<World> w;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    w = std::move(g_world);
  }
}

int get_rank() { return launch_env().rank; }
int get_world_size() { return launch_env().world_size; }

const LaunchEnv& launch_env() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return the_world().env;
}

c10::Device local_cuda_device() {
  compat::require_cuda("device 'cuda'");
  return compat::set_current_cuda_device(local_cuda_index(launch_env(), compat::cuda_device_count()));
}

GroupPtr world_group() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return the_world().world;
}

GroupPtr new_group(const std::vector<int>& ranks, const GroupOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  World& w = the_world();
  HP_CHECK_ARG(!ranks.empty(), "new_group: ranks must not be empty");
  std::vector<bool> seen(w.env.world_size, false);
  for (int r : ranks) {
    HP_CHECK_ARG(r >= 0 && r < w.env.world_size, "new_group: rank ", r, " in ranks ",
                 to_string(ranks), " is out of range for world size ", w.env.world_size);
    HP_CHECK_ARG(!seen[r], "new_group: rank ", r, " appears twice in ranks ", to_string(ranks));
    seen[r] = true;
  }
  HP_CHECK_ARG(options.timeout.count() >= 0, "new_group: timeout must be >= 0 ms, got ",
               options.timeout.count());
  auto key = std::make_tuple(ranks, options.tag, options.backend);
  auto timeout = options.timeout.count() > 0 ? options.timeout : w.timeout;
  auto it = w.groups.find(key);
  if (it != w.groups.end()) {
    HP_CHECK_ARG(it->second->timeout() == timeout, "new_group: ", it->second->describe(),
                 " already exists with timeout ", it->second->timeout().count(),
                 " ms, asked for ", timeout.count(), " ms; give the new one its own tag");
    return it->second;
  }
  auto group = make_group(w, ranks, options.tag, timeout, options.backend);
  w.groups.emplace(key, group);
  return group;
}

}  // namespace hp::dist
