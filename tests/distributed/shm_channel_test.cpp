// The shared-memory channel's segment names and trust, in one process over
// an in-memory store (D6 in docs/features.md): rank 0 unlinks its segment
// on an error path too, connect sweeps the segments of dead creators, and
// a peer refuses a segment that is not this user's or is open to others.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "hp/distributed/shm_channel.h"

namespace hp::dist {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

std::string pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? std::to_string(st.st_ino) : "0";
}

// The /dev/shm names of hp-shm segments containing `part`.
std::vector<std::string> segments_with(const std::string& part) {
  std::vector<std::string> names;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind("hp-shm-", 0) == 0 && name.find(part) != std::string::npos) {
      names.push_back(name);
    }
  }
  ::closedir(dir);
  return names;
}

void set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}
std::string get(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}

// A pid that ran and exited (reaped, so no zombie holds it).
int dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return static_cast<int>(child);
}

bool shm_exists(const std::string& name) {
  struct stat st {};
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

// A segment as a rank 0 makes it (the header's first fields, the size of a
// 2-rank segment: shm_channel.cpp's layout), with mode `mode` and owner `uid`.
void make_segment(const std::string& name, uint64_t token, mode_t mode, uid_t uid) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << name << ": " << std::strerror(errno);
  const int64_t bytes = 4096 + 2 * 3 * (int64_t{1} << 20);
  ASSERT_EQ(::ftruncate(fd, bytes), 0);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  const uint64_t magic = 0x68702d73686d0001;
  const int32_t size = 2;
  std::memcpy(static_cast<char*>(p), &magic, 8);
  std::memcpy(static_cast<char*>(p) + 8, &token, 8);
  std::memcpy(static_cast<char*>(p) + 16, &size, 4);
  ::munmap(p, bytes);
  ASSERT_EQ(::fchmod(fd, mode), 0);
  if (uid != ::geteuid()) ASSERT_EQ(::fchown(fd, uid, static_cast<gid_t>(-1)), 0);
  ::close(fd);
}

TEST(ShmChannelSegments, RankZeroUnlinksItsSegmentWhenAPeerNeverAnswers) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(300ms);
  const std::string mine = "-" + std::to_string(::getpid()) + "-";
  ASSERT_TRUE(segments_with(mine).empty());
  // Rank 1 never sets its key: rank 0's wait for it times out and throws.
  EXPECT_ANY_THROW(ShmChannel::connect(*store, 0, 2, 1000ms, "test group"));
  EXPECT_THAT(segments_with(mine), ::testing::IsEmpty())
      << "rank 0's segment outlived a connect that failed";
}

TEST(ShmChannelSegments, ConnectSweepsTheSegmentsOfDeadCreators) {
  const std::string ns = pid_namespace();
  const std::string dead = "/hp-shm-" + ns + "-" + std::to_string(dead_pid()) + "-17";
  const std::string alive = "/hp-shm-" + ns + "-" + std::to_string(::getppid()) + "-18";
  make_segment(dead, 17, 0600, ::geteuid());
  make_segment(alive, 18, 0600, ::geteuid());
  ASSERT_TRUE(shm_exists(dead));
  auto store = c10::make_intrusive<c10d::HashStore>();
  set(*store, "shm/ready/1", "off");  // a peer that takes no channel
  EXPECT_EQ(ShmChannel::connect(*store, 0, 2, 1000ms, "test group"), nullptr);
  EXPECT_FALSE(shm_exists(dead)) << dead << ": its creator exited and no one unlinked it";
  EXPECT_TRUE(shm_exists(alive)) << alive << ": its creator runs";
  ::shm_unlink(alive.c_str());
}

// Rank 1 of a group whose store names `name` (rank 0 ready): returns what
// rank 1 reported, after checking it got no channel.
std::string peer_verdict(const std::string& name, uint64_t token) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(2000ms);
  set(*store, "shm/segment", name + " " + std::to_string(token));
  set(*store, "shm/ready/0", "ok");
  EXPECT_EQ(ShmChannel::connect(*store, 1, 2, 1000ms, "test group"), nullptr);
  return get(*store, "shm/ready/1");
}

TEST(ShmChannelSegments, APeerRefusesASegmentOpenToOthers) {
  const std::string name = "/hp-shm-" + pid_namespace() + "-" + std::to_string(::getpid()) + "-21";
  make_segment(name, 21, 0644, ::geteuid());
  EXPECT_THAT(peer_verdict(name, 21),
              AllOf(HasSubstr(name), HasSubstr("mode 0644"), HasSubstr("expected this user's")));
  ::shm_unlink(name.c_str());
}

TEST(ShmChannelSegments, APeerRefusesAnotherUsersSegment) {
  if (::geteuid() != 0) GTEST_SKIP() << "giving a segment to another user needs root";
  const std::string name = "/hp-shm-" + pid_namespace() + "-" + std::to_string(::getpid()) + "-22";
  make_segment(name, 22, 0600, 65534);
  EXPECT_THAT(peer_verdict(name, 22),
              AllOf(HasSubstr(name), HasSubstr("owned by uid 65534"), HasSubstr("mode 0600")));
  ::shm_unlink(name.c_str());
}

}  // namespace
}  // namespace hp::dist
