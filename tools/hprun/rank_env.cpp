#include "tools/hprun/rank_env.h"

#include <algorithm>
#include <cstring>
#include <iterator>

namespace hp::launcher {
namespace {

constexpr const char* kDefined[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RESTART_COUNT",
                                    "TORCHELASTIC_MAX_RESTARTS"};
constexpr const char* kDroppedPrefix = "OMPI_COMM_WORLD_";
// The agents' secret (agent_protocol.h) is hprun's, not the program's.
constexpr const char* kDropped = "HPRUN_RDZV_SECRET";

bool replaced_by_hprun(const char* entry) {
  const char* eq = std::strchr(entry, '=');
  std::string name = eq ? std::string(entry, eq) : std::string(entry);
  if (name.rfind(kDroppedPrefix, 0) == 0 || name == kDropped) return true;
  return std::find(std::begin(kDefined), std::end(kDefined), name) != std::end(kDefined);
}

}  // namespace

std::vector<std::string> rank_environment(const LaunchOptions& options, int master_port,
                                          int local_rank, int restart_count,
                                          const char* const* inherited) {
  std::vector<std::string> env;
  for (const char* const* entry = inherited; entry && *entry; ++entry) {
    if (!replaced_by_hprun(*entry)) env.emplace_back(*entry);
  }
  auto set = [&env](const char* name, const std::string& value) {
    env.push_back(std::string(name) + "=" + value);
  };
  set("RANK", std::to_string(options.global_rank(local_rank)));
  set("WORLD_SIZE", std::to_string(options.world_size()));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node));
  set("MASTER_ADDR", options.master_addr);
  set("MASTER_PORT", std::to_string(master_port));
  set("GROUP_RANK", std::to_string(options.node_rank));
  set("NODE_RANK", std::to_string(options.node_rank));
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts));
  return env;
}

}  // namespace hp::launcher
