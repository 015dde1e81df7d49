#include "hp/distributed/shm_channel.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <mutex>
#include <new>
#include <random>
#include <regex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "hp/util/env.h"
#include "hp/util/format.h"

namespace hp::dist {
// Named, not anonymous: ShmChannel::Impl (declared in the header) holds them.
namespace shm_detail {

// Segment layout: a header page, then two buffers (alternate chunks use
// alternate buffers), each with one slot per rank plus a result slot for
// all-reduce. A slot bounds a chunk: an operation larger than a slot runs
// as several chunks. 1 MiB keeps the segment small (6 MiB for 2 ranks,
// 10 MiB for 4) while a chunk's copy still dwarfs the cost of a meeting.
constexpr int kMaxRanks = 16;
constexpr int64_t kSlotBytes = int64_t{1} << 20;
constexpr size_t kHeaderBytes = 4096;
constexpr uint64_t kMagic = 0x68702d73686d0001;  // "hp-shm", layout 1

struct alignas(64) RankInfo {
  std::atomic<uint32_t> meetings;  // meetings this rank has arrived at
  int32_t pid;
  uint64_t pid_namespace;  // inode of /proc/self/ns/pid: pids compare only within one
};

struct Header {
  uint64_t magic;
  uint64_t token;  // rank 0's random number: proves peers mapped the same segment
  int32_t size;
  alignas(64) std::atomic<uint32_t> arrived;  // arrivals at meetings, all ranks, wrapping
  alignas(64) std::atomic<int32_t> failed;    // 1 + the group rank that failed first, or 0
  RankInfo ranks[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit its page");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain words");

// A mapped segment; unmapped on destruction.
struct Mapping {
  void* base = nullptr;
  int64_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& other) noexcept { *this = std::move(other); }
  Mapping& operator=(Mapping&& other) noexcept {
    std::swap(base, other.base);
    std::swap(bytes, other.bytes);
    return *this;
  }
  ~Mapping() {
    if (base) ::munmap(base, static_cast<size_t>(bytes));
  }
};

}  // namespace shm_detail

namespace {

using shm_detail::Header;
using shm_detail::kHeaderBytes;
using shm_detail::kMagic;
using shm_detail::kMaxRanks;
using shm_detail::kSlotBytes;
using shm_detail::Mapping;
using shm_detail::RankInfo;

int64_t segment_bytes(int size) {
  return static_cast<int64_t>(kHeaderBytes) + 2 * (size + 1) * kSlotBytes;
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Whether `pid` names a live process (a zombie is not).
bool process_alive(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat(cat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

// Records this process in its rank's entry, for the peers' liveness checks.
void attach(Header* header, int rank) {
  header->ranks[rank].pid = static_cast<int32_t>(::getpid());
  header->ranks[rank].pid_namespace = pid_namespace();
}

std::string errno_text(const char* what) { return cat(what, ": ", std::strerror(errno)); }

std::string octal(unsigned mode) {
  char text[16];
  std::snprintf(text, sizeof text, "%03o", mode);
  return text;
}

// Segment names carry the creator's pid namespace and pid, so that a
// segment whose creator died before unlinking it (killed between creating
// and unlinking, the only window in which a segment has a name) can be told
// from a live one and swept.
std::string segment_name(uint64_t token) {
  return cat("/hp-shm-", pid_namespace(), "-", ::getpid(), "-", token);
}

// Unlinks every hp-shm segment in /dev/shm that this user owns and whose
// creator, in this pid namespace, no longer runs. Best effort: a segment it
// cannot judge (another namespace, another user, an older name) stays.
void sweep_dead_segments() {
  static const std::regex kName("hp-shm-([0-9]+)-([0-9]+)-([0-9]+)");
  const uint64_t mine = pid_namespace();
  if (mine == 0) return;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  std::vector<std::string> dead;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    std::smatch match;
    if (!std::regex_match(name, match, kName)) continue;
    try {
      if (std::stoull(match[1].str()) != mine) continue;
      const unsigned long long pid = std::stoull(match[2].str());
      if (pid == 0 || pid > static_cast<unsigned long long>(INT32_MAX)) continue;
      struct stat st {};
      if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) continue;
      if (!process_alive(static_cast<int>(pid))) dead.push_back("/" + name);
    } catch (const std::exception&) {
      // Digits beyond 64 bits: not a name this code made.
    }
  }
  ::closedir(dir);
  for (const std::string& name : dead) ::shm_unlink(name.c_str());
}

// Rank 0's segment name, unlinked when it goes out of scope: on the normal
// path once every member has mapped it or given up, and on every error path
// (a store that times out, a peer that never answers).
struct NameOwner {
  std::string name;
  NameOwner() = default;
  NameOwner(const NameOwner&) = delete;
  NameOwner& operator=(const NameOwner&) = delete;
  void unlink() {
    if (!name.empty()) ::shm_unlink(name.c_str());
    name.clear();
  }
  ~NameOwner() { unlink(); }
};

// Maps the named segment; `create` makes it (with its pages reserved, so a
// full /dev/shm is an error here rather than a SIGBUS later).
Mapping map_segment(const std::string& name, int64_t bytes, bool create) {
  const int fd = create ? ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error(errno_text(cat("shm_open ", name).c_str()));
  std::string failure;
  if (create) {
    const int rc = ::posix_fallocate(fd, 0, bytes);
    if (rc != 0) failure = cat("reserving ", bytes, " bytes in ", name, ": ", std::strerror(rc));
  } else {
    // A name from the store is input: only this user's segment, closed to
    // everyone else as rank 0 creates it, is mapped (another user's could
    // feed or read this rank's tensors).
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      failure = errno_text(cat("fstat ", name).c_str());
    } else if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
      failure = cat("shared-memory segment ", name, " is owned by uid ", st.st_uid,
                    " with mode 0", octal(st.st_mode & 0777), "; expected this user's (uid ",
                    ::geteuid(), ") with mode 0600 (no access for group or others): not "
                    "mapping it");
    } else if (st.st_size != bytes) {
      failure = cat(name, " has ", st.st_size, " bytes, expected ", bytes);
    }
  }
  Mapping m;
  if (failure.empty()) {
    void* p =
        ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      failure = errno_text(cat("mmap ", name).c_str());
    } else {
      m.base = p;
      m.bytes = bytes;
    }
  }
  ::close(fd);
  if (!failure.empty()) {
    if (create) ::shm_unlink(name.c_str());
    throw std::runtime_error(failure);
  }
  return m;
}

std::string store_get(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> value = store.get(key);
  return std::string(value.begin(), value.end());
}

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

}  // namespace

class ShmChannel::Impl {
 public:
  Impl(Mapping mapping, int rank, int size, std::chrono::milliseconds timeout,
       std::string description)
      : mapping_(std::move(mapping)),
        header_(static_cast<Header*>(mapping_.base)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        description_(std::move(description)),
        thread_([this] { run(); }) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  void submit(Op op, std::function<void(std::exception_ptr)> done) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace_back(std::move(op), std::move(done));
    }
    wake_.notify_one();
  }

 private:
  using Entry = std::pair<Op, std::function<void(std::exception_ptr)>>;

  void run() {
    pthread_setname_np(pthread_self(), "hp-shm");
    for (;;) {
      Entry entry;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        if (stopping_) {
          // Peers may be waiting for these; failing them here is all a
          // destroyed group can do (their own wait times out).
          entry = std::move(queue_.front());
          queue_.pop_front();
          lock.unlock();
          entry.second(std::make_exception_ptr(
              std::runtime_error(cat("the shared-memory channel of ", description_,
                                     " was destroyed before this collective ran"))));
          continue;
        }
        entry = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failure;
      if (!broken_.empty()) {
        failure = std::make_exception_ptr(
            std::runtime_error(cat("the shared-memory channel of ", description_,
                                   " is unusable since an earlier collective failed (", broken_,
                                   "); no later collective on this group can run")));
      } else {
        try {
          execute(entry.first);
        } catch (const std::exception& e) {
          broken_ = e.what();
          failure = std::current_exception();
          // Peers stop waiting for this rank and fail too.
          int32_t none = 0;
          header_->failed.compare_exchange_strong(none, rank_ + 1);
          futex(&header_->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
        }
      }
      entry.first = Op();  // the tensors go before the caller hears
      entry.second(failure);
    }
  }

  char* slot(int buffer, int r) const {
    return static_cast<char*>(mapping_.base) + kHeaderBytes +
           (static_cast<int64_t>(buffer) * (size_ + 1) + r) * kSlotBytes;
  }
  char* result(int buffer) const { return slot(buffer, size_); }
  // Chunks alternate buffers: a rank writes a buffer again only after
  // passing the next chunk's meeting, which every rank reaches after it
  // finished reading that buffer.
  int next_buffer() { return static_cast<int>(chunks_++ & 1); }

  void execute(const Op& op) {
    switch (op.kind) {
      case Kind::kAllGather:
        return all_gather(op.input, op.output);
      case Kind::kAllGatherCoalesced:
        return all_gather_coalesced(op.inputs, op.outputs);
      case Kind::kReduceScatter:
        return reduce_scatter(op.input, op.output, op.reduce);
      case Kind::kAllReduce:
        return all_reduce(op.input, op.reduce);
    }
  }

  void all_gather(const at::Tensor& input, const at::Tensor& output) {
    const auto* in = static_cast<const char*>(input.data_ptr());
    auto* out = static_cast<char*>(output.data_ptr());
    const int64_t bytes = static_cast<int64_t>(input.nbytes());
    for (int64_t offset = 0; offset < bytes; offset += kSlotBytes) {
      const int64_t len = std::min(kSlotBytes, bytes - offset);
      const int b = next_buffer();
      std::memcpy(slot(b, rank_), in + offset, len);
      meet();
      for (int r = 0; r < size_; ++r) std::memcpy(out + r * bytes + offset, slot(b, r), len);
    }
  }

  // The inputs travel as one byte stream, in order, chunked like one input;
  // each rank's part of a chunk goes straight to the outputs it covers.
  void all_gather_coalesced(const std::vector<at::Tensor>& inputs,
                            const std::vector<std::vector<at::Tensor>>& outputs) {
    std::vector<int64_t> offsets(inputs.size() + 1, 0);  // of input i in the stream
    for (size_t i = 0; i < inputs.size(); ++i) {
      offsets[i + 1] = offsets[i] + static_cast<int64_t>(inputs[i].nbytes());
    }
    // Calls fn(i, from, to) for the byte range [from, to) of input i that
    // falls in the stream's [begin, end).
    auto for_each_piece = [&offsets](int64_t begin, int64_t end, const auto& fn) {
      for (size_t i = 0; i + 1 < offsets.size(); ++i) {
        const int64_t from = std::max(begin, offsets[i]), to = std::min(end, offsets[i + 1]);
        if (from < to) fn(i, from - offsets[i], to - offsets[i]);
      }
    };
    const int64_t total = offsets.back();
    for (int64_t begin = 0; begin < total; begin += kSlotBytes) {
      const int64_t end = std::min(total, begin + kSlotBytes);
      const int b = next_buffer();
      for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t to) {
        std::memcpy(slot(b, rank_) + offsets[i] + from - begin,
                    static_cast<const char*>(inputs[i].data_ptr()) + from, to - from);
      });
      meet();
      for (int r = 0; r < size_; ++r) {
        for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t to) {
          std::memcpy(static_cast<char*>(outputs[r][i].data_ptr()) + from,
                      slot(b, r) + offsets[i] + from - begin, to - from);
        });
      }
    }
  }

  void reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp reduce) {
    const int64_t esize = input.element_size(), n = output.numel();
    const auto* in = static_cast<const char*>(input.data_ptr());
    const int64_t per_chunk = kSlotBytes / (esize * size_);  // elements of the output
    for (int64_t offset = 0; offset < n; offset += per_chunk) {
      const int64_t len = std::min(per_chunk, n - offset);
      const int b = next_buffer();
      // Block r of this rank's slot holds what group rank r will reduce.
      for (int r = 0; r < size_; ++r) {
        std::memcpy(slot(b, rank_) + r * len * esize, in + (r * n + offset) * esize, len * esize);
      }
      meet();
      std::vector<at::Tensor> parts;
      parts.reserve(size_);
      for (int r = 0; r < size_; ++r)
        parts.push_back(view(slot(b, r) + rank_ * len * esize, len, input));
      reduce_into(output.view(-1).narrow(0, offset, len), parts, reduce);
    }
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp reduce) {
    const int64_t esize = tensor.element_size(), n = tensor.numel();
    auto* data = static_cast<char*>(tensor.data_ptr());
    const int64_t per_chunk = kSlotBytes / esize;
    for (int64_t offset = 0; offset < n; offset += per_chunk) {
      const int64_t len = std::min(per_chunk, n - offset);
      const int b = next_buffer();
      std::memcpy(slot(b, rank_), data + offset * esize, len * esize);
      meet();
      // This rank reduces its piece of the chunk into the result slot...
      const int64_t begin = len * rank_ / size_, end = len * (rank_ + 1) / size_;
      if (end > begin) {
        std::vector<at::Tensor> parts;
        parts.reserve(size_);
        for (int r = 0; r < size_; ++r) {
          parts.push_back(view(slot(b, r) + begin * esize, end - begin, tensor));
        }
        reduce_into(view(result(b) + begin * esize, end - begin, tensor), parts, reduce);
      }
      meet();
      // ...and every rank copies out the whole chunk.
      std::memcpy(data + offset * esize, result(b), len * esize);
    }
  }

  static at::Tensor view(char* p, int64_t numel, const at::Tensor& like) {
    return at::from_blob(p, {numel}, at::TensorOptions().dtype(like.scalar_type()));
  }

  // dst = parts[0] op parts[1] op ... in group-rank order.
  static void reduce_into(at::Tensor dst, const std::vector<at::Tensor>& parts, ReduceOp reduce) {
    switch (reduce) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        at::add_out(dst, parts[0], parts[1]);
        for (size_t i = 2; i < parts.size(); ++i) dst.add_(parts[i]);
        return;
      case ReduceOp::kMax:
        at::maximum_out(dst, parts[0], parts[1]);
        for (size_t i = 2; i < parts.size(); ++i) at::maximum_out(dst, dst, parts[i]);
        return;
      case ReduceOp::kMin:
        at::minimum_out(dst, parts[0], parts[1]);
        for (size_t i = 2; i < parts.size(); ++i) at::minimum_out(dst, dst, parts[i]);
        return;
    }
  }

  // Waits until every rank has arrived at this meeting. Writes before a
  // rank's arrival are visible to every rank after the meeting (the
  // arrival is a release, the wait an acquire on the same counter).
  void meet() {
    // A peer that failed may have arrived at a meeting it then abandoned:
    // completing that meeting would pair this rank's chunk with stale data.
    check_no_peer_failed();
    ++meetings_;
    header_->ranks[rank_].meetings.store(meetings_, std::memory_order_relaxed);
    // The counter wraps; so does the target, and they compare as a signed
    // difference (no rank is ever a whole meeting ahead of another).
    const uint32_t target = meetings_ * static_cast<uint32_t>(size_);
    const uint32_t now = header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (now == target) {
      futex(&header_->arrived, FUTEX_WAKE, INT32_MAX, nullptr);
      return;
    }
    // Spinning costs a core another rank may need, so only briefly.
    constexpr int kSpins = 200;
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout_;
    auto next_liveness_check = start + std::chrono::milliseconds(100);
    for (int spin = 0;; ++spin) {
      const uint32_t seen = header_->arrived.load(std::memory_order_acquire);
      if (static_cast<int32_t>(seen - target) >= 0) return;
      check_no_peer_failed(/*waiting=*/true);
      if (spin < kSpins) {
        cpu_relax();
        continue;
      }
      const auto now_time = std::chrono::steady_clock::now();
      if (now_time >= deadline) {
        throw std::runtime_error(cat("timed out after ", timeout_.count(),
                                     " ms waiting for "
                                     "group rank(s) ",
                                     to_string(absent()),
                                     " in the "
                                     "shared-memory channel"));
      }
      if (now_time >= next_liveness_check) {
        check_absent_alive();
        next_liveness_check = now_time + std::chrono::milliseconds(100);
      }
      const auto slice =
          std::min<std::chrono::nanoseconds>(deadline - now_time, std::chrono::milliseconds(100));
      timespec ts{};
      ts.tv_sec = static_cast<time_t>(slice.count() / 1000000000);
      ts.tv_nsec = static_cast<long>(slice.count() % 1000000000);
      futex(&header_->arrived, FUTEX_WAIT, seen, &ts);
    }
  }

  // `waiting`: this rank has arrived and waits for the others, who are
  // then named too (the failed rank may not be the one that is missing).
  void check_no_peer_failed(bool waiting = false) const {
    const int32_t failed = header_->failed.load(std::memory_order_acquire);
    if (failed == 0) return;
    std::string absent_ranks;
    if (waiting) {
      absent_ranks = cat(" while this rank waited for group rank(s) ", to_string(absent()));
    }
    throw std::runtime_error(cat("group rank ", failed - 1,
                                 " failed in the shared-memory channel (its own error says why)",
                                 absent_ranks));
  }

  // Group ranks not yet at this rank's current meeting.
  std::vector<int> absent() const {
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r) {
      const uint32_t theirs = header_->ranks[r].meetings.load(std::memory_order_relaxed);
      if (static_cast<int32_t>(theirs - meetings_) < 0) ranks.push_back(r);
    }
    return ranks;
  }

  // A peer that exited never arrives: say so now rather than at the timeout.
  // Pids mean something only within one pid namespace.
  void check_absent_alive() const {
    for (int r : absent()) {
      const RankInfo& info = header_->ranks[r];
      const uint64_t mine = header_->ranks[rank_].pid_namespace;
      if (info.pid_namespace == 0 || info.pid_namespace != mine) continue;
      if (!process_alive(info.pid)) {
        throw std::runtime_error(cat("group rank ", r, " (pid ", info.pid,
                                     ") exited while this rank waited for it in the "
                                     "shared-memory channel"));
      }
    }
  }

  Mapping mapping_;
  Header* header_;
  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  const std::string description_;
  // The channel thread's own state.
  uint32_t meetings_ = 0;
  uint64_t chunks_ = 0;
  std::string broken_;  // the first failure, once there was one
  // Shared with submitters.
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

ShmChannel::ShmChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShmChannel::~ShmChannel() = default;

void ShmChannel::submit(Op op, std::function<void(std::exception_ptr)> done) {
  impl_->submit(std::move(op), std::move(done));
}

std::unique_ptr<ShmChannel> ShmChannel::connect(c10d::Store& store, int rank, int size,
                                                std::chrono::milliseconds timeout,
                                                const std::string& description) {
  // Every member takes every step below, whatever happens to it, so that a
  // rank that cannot map the segment turns the channel off everywhere
  // instead of leaving a peer waiting.
  // Why this rank cannot use a channel: kOff when by choice (HP_SHM=0, a
  // group size without one), else the error that prevented it.
  static const std::string kOff = "off";
  std::string refusal;
  if (!hp::env::get_bool("HP_SHM", true) || size < 2 || size > kMaxRanks) refusal = kOff;
  const int64_t bytes = segment_bytes(std::min(size, kMaxRanks));
  if (refusal.empty()) sweep_dead_segments();
  Mapping mapping;
  NameOwner name;
  if (rank == 0) {
    uint64_t token = 0;
    if (refusal.empty()) {
      std::random_device entropy;
      token = (uint64_t{entropy()} << 32) ^ entropy();
      try {
        const std::string created = segment_name(token);
        mapping = map_segment(created, bytes, /*create=*/true);
        name.name = created;
        auto* header = new (mapping.base) Header();
        header->magic = kMagic;
        header->token = token;
        header->size = size;
      } catch (const std::exception& e) {
        refusal = e.what();
        name.unlink();
      }
    }
    store_set(store, "shm/segment", refusal.empty() ? cat(name.name, " ", token) : std::string());
  } else {
    const std::string offer = store_get(store, "shm/segment");
    const size_t space = offer.find(' ');
    if (offer.empty() || space == std::string::npos) {
      if (refusal.empty()) refusal = kOff;  // rank 0 says why
    } else if (refusal.empty()) {
      try {
        mapping = map_segment(offer.substr(0, space), bytes, /*create=*/false);
        const auto* header = static_cast<const Header*>(mapping.base);
        const uint64_t token = std::stoull(offer.substr(space + 1));
        if (header->magic != kMagic || header->token != token || header->size != size) {
          refusal = cat(offer.substr(0, space),
                        " is not group rank 0's segment (another "
                        "/dev/shm: a peer on another host or in another container)");
        }
      } catch (const std::exception& e) {
        refusal = e.what();
      }
    }
  }
  if (refusal.empty()) attach(static_cast<Header*>(mapping.base), rank);
  store_set(store, cat("shm/ready/", rank), refusal.empty() ? "ok" : refusal);
  bool everyone = true;
  std::string errors;
  for (int r = 0; r < size; ++r) {
    const std::string ready = store_get(store, cat("shm/ready/", r));
    everyone = everyone && ready == "ok";
    if (ready != "ok" && ready != kOff) errors += cat("; group rank ", r, ": ", ready);
  }
  // Everyone has mapped the segment or given up: the name can go.
  name.unlink();
  // Not an error (Gloo carries everything), but slower: say why, once.
  if (rank == 0 && !errors.empty()) {
    std::cerr << "hp::dist: " << description << " moves its collectives through Gloo only, "
              << "without shared memory" << errors << std::endl;
  }
  if (!everyone) return nullptr;
  return std::unique_ptr<ShmChannel>(
      new ShmChannel(std::make_unique<Impl>(std::move(mapping), rank, size, timeout, description)));
}

}  // namespace hp::dist
