#include "hp/distributed/recording_stream_ops.h"

#include <sstream>

namespace hp::dist {
namespace {

// The calling thread's current stream under the recording (one recording
// is installed at a time).
thread_local StreamRole t_current = StreamRole::kCompute;

}  // namespace

const char* to_string(RecordingStreamOps::Kind kind) {
  using Kind = RecordingStreamOps::Kind;
  switch (kind) {
    case Kind::kRecord: return "record";
    case Kind::kWait: return "wait";
    case Kind::kHostWait: return "host_wait";
    case Kind::kAlloc: return "alloc";
    case Kind::kUse: return "use";
    case Kind::kRelease: return "release";
    case Kind::kCollective: return "collective";
    case Kind::kMark: return "mark";
  }
  return "?";
}

StreamRole RecordingStreamOps::current() const { return t_current; }

StreamRole RecordingStreamOps::set_current(StreamRole role) {
  return std::exchange(t_current, role);
}

void RecordingStreamOps::append(Entry entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  log_.push_back(std::move(entry));
}

StreamEvent RecordingStreamOps::record(StreamRole stream, const char* tag) {
  StreamEvent event;
  event.stream = stream;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    event.id = next_event_++;
    log_.push_back({Kind::kRecord, stream, event.id, tag});
  }
  return event;
}

void RecordingStreamOps::wait(StreamRole waiter, const StreamEvent& event) {
  if (!event.defined()) return;
  append({Kind::kWait, waiter, event.id, ""});
}

void RecordingStreamOps::host_wait(const StreamEvent& event) {
  if (!event.defined()) return;
  append({Kind::kHostWait, event.stream, event.id, ""});
}

bool RecordingStreamOps::query(const StreamEvent&) { return true; }

void RecordingStreamOps::on_alloc(const void* buffer, StreamRole stream, const char* what) {
  append({Kind::kAlloc, stream, 0, what, buffer});
}

void RecordingStreamOps::on_use(const void* buffer, StreamRole stream) {
  append({Kind::kUse, stream, 0, "", buffer});
}

void RecordingStreamOps::on_release(const void* buffer, StreamRole stream) {
  append({Kind::kRelease, stream, 0, "", buffer});
}

void RecordingStreamOps::on_collective(StreamRole stream, const char* op, int64_t bytes) {
  Entry entry{Kind::kCollective, stream, 0, op};
  entry.bytes = bytes;
  append(std::move(entry));
}

void RecordingStreamOps::on_mark(const char* what) {
  append({Kind::kMark, StreamRole::kCompute, 0, what});
}

std::vector<RecordingStreamOps::Entry> RecordingStreamOps::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return log_;
}

void RecordingStreamOps::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  log_.clear();
}

std::string RecordingStreamOps::format(const std::vector<Entry>& entries, size_t first,
                                       size_t count) {
  std::ostringstream out;
  for (size_t i = first; i < entries.size() && i - first < count; ++i) {
    const Entry& e = entries[i];
    out << i << ": " << to_string(e.kind) << " " << to_string(e.stream);
    if (e.event != 0) out << " #" << e.event;
    if (e.buffer != nullptr) out << " " << e.buffer;
    if (!e.tag.empty()) out << " " << e.tag;
    if (e.bytes != 0) out << " " << e.bytes << " B";
    out << "\n";
  }
  return out.str();
}

}  // namespace hp::dist
