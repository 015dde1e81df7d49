// read_launch_env and started_by_launcher over a fake environment: both
// conventions, and every missing, malformed or contradictory variable
// (D1 in docs/features.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>

#include "hp/distributed/launch_env.h"
#include "hp/util/error.h"

namespace hp::dist {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Env = std::map<std::string, std::string>;

EnvLookup lookup_in(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

// Reading `env`, as a call for EXPECT_THAT(..., ThrowsMessage<...>(...)).
std::function<void()> reading(const Env& env) {
  return [env] { read_launch_env(lookup_in(env)); };
}

const Env kTorchrun = {{"RANK", "2"},           {"WORLD_SIZE", "4"},
                       {"LOCAL_RANK", "0"},     {"LOCAL_WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};

TEST(LaunchEnv, ReadsTorchrunVariables) {
  LaunchEnv env = read_launch_env(lookup_in(kTorchrun));
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "torchrun");
}

TEST(LaunchEnv, StartedByLauncherSeesEitherConvention) {
  EXPECT_FALSE(started_by_launcher(lookup_in({{"MASTER_ADDR", "127.0.0.1"}})));
  EXPECT_TRUE(started_by_launcher(lookup_in(kTorchrun)));
  EXPECT_TRUE(started_by_launcher(lookup_in({{"WORLD_SIZE", "2"}})));
  EXPECT_TRUE(started_by_launcher(lookup_in({{"OMPI_COMM_WORLD_RANK", "0"}})));
  EXPECT_TRUE(started_by_launcher(lookup_in({{"OMPI_COMM_WORLD_SIZE", "2"}})));
}

TEST(LaunchEnv, ReadsOpenMpiVariables) {
  Env mpi = {{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"},
             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
             {"MASTER_ADDR", "10.0.0.1"},         {"MASTER_PORT", "1234"}};
  LaunchEnv env = read_launch_env(lookup_in(mpi));
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.source, "openmpi");
}

TEST(LaunchEnv, LocalRankDefaultsToSingleNode) {
  Env env = kTorchrun;
  env.erase("LOCAL_RANK");
  env.erase("LOCAL_WORLD_SIZE");
  LaunchEnv e = read_launch_env(lookup_in(env));
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.local_rank, 2);
}

TEST(LaunchEnv, AgreeingConventionsAreAccepted) {
  Env env = kTorchrun;
  env["OMPI_COMM_WORLD_RANK"] = "2";
  EXPECT_EQ(read_launch_env(lookup_in(env)).rank, 2);
}

TEST(LaunchEnv, MissingRankNamesTheVariablesAndTheLauncher) {
  EXPECT_THAT(
      reading({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}}),
      ThrowsMessage<ArgumentError>(AllOf(HasSubstr("RANK is not set"),
                                         HasSubstr("OMPI_COMM_WORLD_RANK"), HasSubstr("hprun"))));
  EXPECT_THAT(reading({}), ThrowsMessage<ArgumentError>(HasSubstr("RANK is not set")));
}

TEST(LaunchEnv, MissingWorldSize) {
  EXPECT_THAT(
      reading({{"RANK", "0"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}}),
      ThrowsMessage<ArgumentError>(AllOf(HasSubstr("WORLD_SIZE is not set"), HasSubstr("RANK=0"))));
}

TEST(LaunchEnv, MissingMasterAddrAndPort) {
  Env env = kTorchrun;
  env.erase("MASTER_ADDR");
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(HasSubstr("MASTER_ADDR is not set")));
  env = kTorchrun;
  env.erase("MASTER_PORT");
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(HasSubstr("MASTER_PORT is not set")));
}

TEST(LaunchEnv, MalformedValuesNameVariableAndValue) {
  Env env = kTorchrun;
  env["WORLD_SIZE"] = "four";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(
                                HasSubstr("WORLD_SIZE must be a positive integer, got 'four'")));
  env = kTorchrun;
  env["WORLD_SIZE"] = "0";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(HasSubstr("got '0'")));
  env = kTorchrun;
  env["RANK"] = "-1";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(
                                HasSubstr("RANK must be a non-negative integer, got '-1'")));
  env = kTorchrun;
  env["MASTER_PORT"] = "70000";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(HasSubstr(
                                "MASTER_PORT must be a TCP port in 1..65535, got '70000'")));
}

TEST(LaunchEnv, RankOutOfRange) {
  Env env = kTorchrun;
  env["RANK"] = "4";
  EXPECT_THAT(reading(env),
              ThrowsMessage<ArgumentError>(HasSubstr("RANK=4 is out of range for WORLD_SIZE=4")));
  env = kTorchrun;
  env["LOCAL_RANK"] = "2";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(
                                HasSubstr("LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2")));
}

TEST(LaunchEnv, ContradictoryConventions) {
  Env env = kTorchrun;
  env["OMPI_COMM_WORLD_RANK"] = "1";
  EXPECT_THAT(reading(env),
              ThrowsMessage<ArgumentError>(HasSubstr("RANK=2 contradicts OMPI_COMM_WORLD_RANK=1")));
  env = kTorchrun;
  env["OMPI_COMM_WORLD_SIZE"] = "8";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(
                                HasSubstr("WORLD_SIZE=4 contradicts OMPI_COMM_WORLD_SIZE=8")));
}

// One GPU per local rank; more local ranks than GPUs only when asked for.
TEST(LocalCudaIndex, IsTheLocalRankAndRefusesSharingUnlessAsked) {
  Env env = kTorchrun;
  env["LOCAL_RANK"] = "1";
  LaunchEnv launch = read_launch_env(lookup_in(env));
  EXPECT_FALSE(launch.share_gpus);
  EXPECT_EQ(local_cuda_index(launch, 2), 1);
  EXPECT_THAT([&] { local_cuda_index(launch, 1); },
              ThrowsMessage<ArgumentError>(AllOf(
                  HasSubstr("LOCAL_RANK=1 has no GPU of its own"),
                  HasSubstr("1 CUDA device(s) for LOCAL_WORLD_SIZE=2"),
                  HasSubstr("HP_SHARE_GPUS=1"))));
  env["HP_SHARE_GPUS"] = "1";
  launch = read_launch_env(lookup_in(env));
  EXPECT_TRUE(launch.share_gpus);
  EXPECT_EQ(local_cuda_index(launch, 1), 0);
  EXPECT_EQ(local_cuda_index(launch, 2), 1);
  env["HP_SHARE_GPUS"] = "yes";
  EXPECT_THAT(reading(env), ThrowsMessage<ArgumentError>(
                                HasSubstr("HP_SHARE_GPUS must be 0 or 1, got 'yes'")));
}

// Ranks sharing a GPU on purpose get an NCCL host id each (NCCL otherwise
// refuses them as one host's duplicate GPU) and, in a job on this host
// alone, loopback for NCCL's sockets; nothing is set without sharing, and a
// variable the user set is left alone.
TEST(NcclEnvForSharedGpus, DistinctHostIdPerLocalRankOnlyWhenSharing) {
  using Vars = std::vector<std::pair<std::string, std::string>>;
  Env env = {{"RANK", "1"},        {"WORLD_SIZE", "2"},          {"LOCAL_RANK", "1"},
             {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"},
             {"HP_SHARE_GPUS", "1"}};
  const LaunchEnv sharing = read_launch_env(lookup_in(env));
  EXPECT_EQ(nccl_env_for_shared_gpus(sharing, 1, "node7", lookup_in(env)),
            (Vars{{"NCCL_HOSTID", "node7:hp-local-rank-1"}, {"NCCL_SOCKET_IFNAME", "lo"}}));
  // One GPU per rank: nothing shared, nothing set.
  EXPECT_TRUE(nccl_env_for_shared_gpus(sharing, 2, "node7", lookup_in(env)).empty());
  EXPECT_TRUE(nccl_env_for_shared_gpus(sharing, 0, "node7", lookup_in(env)).empty());
  // Without HP_SHARE_GPUS, local_cuda_index refuses the job first.
  Env refused = env;
  refused.erase("HP_SHARE_GPUS");
  EXPECT_TRUE(nccl_env_for_shared_gpus(read_launch_env(lookup_in(refused)), 1, "node7",
                                       lookup_in(refused))
                  .empty());
  // The user's own settings win.
  Env own = env;
  own["NCCL_HOSTID"] = "mine";
  own["NCCL_SOCKET_IFNAME"] = "eth0";
  EXPECT_TRUE(nccl_env_for_shared_gpus(sharing, 1, "node7", lookup_in(own)).empty());
  // Ranks on other hosts: NCCL picks a real interface itself.
  Env two_hosts = env;
  two_hosts["WORLD_SIZE"] = "4";
  two_hosts["RANK"] = "3";
  EXPECT_EQ(nccl_env_for_shared_gpus(read_launch_env(lookup_in(two_hosts)), 1, "node7",
                                     lookup_in(two_hosts)),
            (Vars{{"NCCL_HOSTID", "node7:hp-local-rank-1"}}));
}

}  // namespace
}  // namespace hp::dist
