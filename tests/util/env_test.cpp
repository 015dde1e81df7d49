// hp/util/env.h: every variable the library reads is parsed strictly, and a
// bad value names the variable, the value and what was expected.

#include "hp/util/env.h"

#include <cstdlib>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "hp/util/error.h"

namespace hp::env {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}

// Sets a variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

TEST(Env, BoolsAreWordsNotNonEmptiness) {
  for (const char* yes : {"1", "true", "TRUE", "yes", "On"}) EXPECT_TRUE(parse_bool("V", yes));
  for (const char* no : {"0", "false", "False", "no", "OFF"}) EXPECT_FALSE(parse_bool("V", no));
  // HP_CHECK_COLLECTIVES=false used to turn the checks on.
  ScopedEnv set("HP_CHECK_COLLECTIVES", "false");
  EXPECT_FALSE(get_bool("HP_CHECK_COLLECTIVES", true));
  EXPECT_EQ(error_of([] { parse_bool("HP_SHM", "2"); }),
            "HP_SHM must be 1/0, true/false, yes/no or on/off, got '2'");
  EXPECT_NE(error_of([] { parse_bool("HP_SHM", " 1"); }), "");
}

TEST(Env, UnsetOrEmptyTakesTheDefault) {
  ::unsetenv("HP_ENV_TEST_UNSET");
  EXPECT_TRUE(get_bool("HP_ENV_TEST_UNSET", true));
  EXPECT_FALSE(get_int("HP_ENV_TEST_UNSET", 0, 9));
  ScopedEnv empty("HP_ENV_TEST_EMPTY", "");
  EXPECT_FALSE(get_bool("HP_ENV_TEST_EMPTY", false));
  EXPECT_FALSE(get_seconds("HP_ENV_TEST_EMPTY", 1, 2));
}

TEST(Env, IntegersAreDecimalDigitsInRange) {
  EXPECT_EQ(parse_int("MASTER_PORT", "29500", 1, 65535), 29500);
  EXPECT_EQ(parse_int("N", "-3", -5, 5), -3);
  for (const char* bad : {"", " 7", "+7", "7 ", "0x10", "7abc", "99999999999999999999", "-"}) {
    EXPECT_NE(error_of([&] { parse_int("N", bad, -5, 100); }), "") << bad;
  }
  EXPECT_EQ(error_of([] { parse_int("MASTER_PORT", "70000", 1, 65535); }),
            "MASTER_PORT must be an integer in [1, 65535], got '70000'");
}

TEST(Env, SecondsAreFiniteAndInRange) {
  const double year = 365.0 * 24 * 3600;
  EXPECT_DOUBLE_EQ(parse_seconds("HP_TIMEOUT_S", "2.5", 0.001, year), 2.5);
  EXPECT_DOUBLE_EQ(parse_seconds("HP_TIMEOUT_S", "1e3", 0.001, year), 1000);
  // "inf" became a negative timeout, "0.0001" zero (c10d: wait forever),
  // 1e10 overflows a clock's nanoseconds.
  for (const char* bad : {"inf", "-inf", "nan", "0.0001", "0", "-1", "1e10", "", " 5", "5s",
                          "0x10", "1e400"}) {
    std::string message = error_of([&] { parse_seconds("HP_TIMEOUT_S", bad, 0.001, year); });
    EXPECT_NE(message.find("HP_TIMEOUT_S must be a number of seconds in [0.001, "),
              std::string::npos)
        << bad << ": " << message;
    EXPECT_NE(message.find(std::string("got '") + bad + "'"), std::string::npos) << message;
  }
  ScopedEnv set("HP_TIMEOUT_S", "inf");
  EXPECT_NE(error_of([&] { get_seconds("HP_TIMEOUT_S", 0.001, year); }), "");
}

TEST(Env, ChoicesAreExact) {
  ScopedEnv set("HP_CUDA_BACKEND", "NCCL");
  EXPECT_EQ(error_of([] { get_choice("HP_CUDA_BACKEND", {"nccl", "gloo"}); }),
            "HP_CUDA_BACKEND must be 'nccl' or 'gloo', got 'NCCL'");
  ::setenv("HP_CUDA_BACKEND", "gloo", 1);
  EXPECT_EQ(get_choice("HP_CUDA_BACKEND", {"nccl", "gloo"}), "gloo");
}

}  // namespace
}  // namespace hp::env
