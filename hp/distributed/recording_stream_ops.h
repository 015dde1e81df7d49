// StreamOps for tests: the schedule a GPU would run, written down.
//
// orders_by_streams() is true, so the FSDP layer and the collectives facade
// take their stream path on the CPU; nothing runs on any stream (the host
// does the work, and Gloo's host waits keep the data right). Every decision
// is appended to a log: records, waits, host waits, buffer allocations, uses
// and releases, collectives and marks, each with its stream and tag. Tests
// check the ordering rules of docs/streams.md on it and replay it in a small
// simulator for the overlap the schedule allows.
//
// Threads: every call locks the log; entries are in call order.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "hp/distributed/stream_ops.h"

namespace hp::dist {

class RecordingStreamOps : public StreamOps {
 public:
  enum class Kind { kRecord, kWait, kHostWait, kAlloc, kUse, kRelease, kCollective, kMark };
  struct Entry {
    Kind kind;
    StreamRole stream;   // recorded on / waiting / allocating / using / releasing
    uint64_t event = 0;  // kRecord, kWait, kHostWait
    std::string tag;     // the event's tag, the buffer's or collective's name, the mark
    const void* buffer = nullptr;  // kAlloc, kUse, kRelease
    int64_t bytes = 0;             // kCollective
  };

  bool orders_by_streams() const override { return true; }
  StreamRole current() const override;
  StreamRole set_current(StreamRole role) override;
  StreamEvent record(StreamRole stream, const char* tag) override;
  void wait(StreamRole waiter, const StreamEvent& event) override;
  void host_wait(const StreamEvent& event) override;
  bool query(const StreamEvent& event) override;
  void on_alloc(const void* buffer, StreamRole stream, const char* what) override;
  void on_use(const void* buffer, StreamRole stream) override;
  void on_release(const void* buffer, StreamRole stream) override;
  void on_collective(StreamRole stream, const char* op, int64_t bytes) override;
  void on_mark(const char* what) override;

  // A copy of the log so far.
  std::vector<Entry> entries() const;
  void clear();
  // One line per entry ("wait ag <- compute#12 iteration start"), for a
  // failure message.
  static std::string format(const std::vector<Entry>& entries, size_t first = 0,
                            size_t count = SIZE_MAX);

 private:
  void append(Entry entry);

  mutable std::mutex mutex_;
  std::vector<Entry> log_;
  uint64_t next_event_ = 1;
};

const char* to_string(RecordingStreamOps::Kind kind);

}  // namespace hp::dist
