// read_launch_env and started_by_launcher over a fake environment: both
// conventions, and every missing, malformed or contradictory variable
// (D1 in docs/features.md).
#include <gtest/gtest.h>

#include <map>

#include "hp/dist/launch_env.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"

namespace hp::dist {
namespace {

using Env = std::map<std::string, std::string>;

EnvLookup lookup_in(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(const Env& env) {
  return test::message_of<ArgumentError>([&] { read_launch_env(lookup_in(env)); });
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
  std::string m = error_of({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(m.find("RANK is not set"), std::string::npos) << m;
  EXPECT_NE(m.find("OMPI_COMM_WORLD_RANK"), std::string::npos) << m;
  EXPECT_NE(m.find("hprun"), std::string::npos) << m;
  EXPECT_NE(error_of({}).find("RANK is not set"), std::string::npos);
}

TEST(LaunchEnv, MissingWorldSize) {
  std::string m = error_of({{"RANK", "0"}, {"MASTER_ADDR", "x"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(m.find("WORLD_SIZE is not set"), std::string::npos) << m;
  EXPECT_NE(m.find("RANK=0"), std::string::npos) << m;
}

TEST(LaunchEnv, MissingMasterAddrAndPort) {
  Env env = kTorchrun;
  env.erase("MASTER_ADDR");
  EXPECT_NE(error_of(env).find("MASTER_ADDR is not set"), std::string::npos);
  env = kTorchrun;
  env.erase("MASTER_PORT");
  EXPECT_NE(error_of(env).find("MASTER_PORT is not set"), std::string::npos);
}

TEST(LaunchEnv, MalformedValuesNameVariableAndValue) {
  Env env = kTorchrun;
  env["WORLD_SIZE"] = "four";
  std::string m = error_of(env);
  EXPECT_NE(m.find("WORLD_SIZE must be a positive integer, got 'four'"), std::string::npos) << m;
  env = kTorchrun;
  env["WORLD_SIZE"] = "0";
  EXPECT_NE(error_of(env).find("got '0'"), std::string::npos);
  env = kTorchrun;
  env["RANK"] = "-1";
  EXPECT_NE(error_of(env).find("RANK must be a non-negative integer, got '-1'"),
            std::string::npos);
  env = kTorchrun;
  env["MASTER_PORT"] = "70000";
  m = error_of(env);
  EXPECT_NE(m.find("MASTER_PORT must be a TCP port in 1..65535, got '70000'"), std::string::npos)
      << m;
}

TEST(LaunchEnv, RankOutOfRange) {
  Env env = kTorchrun;
  env["RANK"] = "4";
  std::string m = error_of(env);
  EXPECT_NE(m.find("RANK=4 is out of range for WORLD_SIZE=4"), std::string::npos) << m;
  env = kTorchrun;
  env["LOCAL_RANK"] = "2";
  m = error_of(env);
  EXPECT_NE(m.find("LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"), std::string::npos) << m;
}

TEST(LaunchEnv, ContradictoryConventions) {
  Env env = kTorchrun;
  env["OMPI_COMM_WORLD_RANK"] = "1";
  std::string m = error_of(env);
  EXPECT_NE(m.find("RANK=2 contradicts OMPI_COMM_WORLD_RANK=1"), std::string::npos) << m;
  env = kTorchrun;
  env["OMPI_COMM_WORLD_SIZE"] = "8";
  m = error_of(env);
  EXPECT_NE(m.find("WORLD_SIZE=4 contradicts OMPI_COMM_WORLD_SIZE=8"), std::string::npos) << m;
}

}  // namespace
}  // namespace hp::dist
