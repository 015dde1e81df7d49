#include "hp/util/gpu_trace.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <utility>

namespace hp::trace {

std::string gpu_lane(const std::string& lane) { return "gpu " + lane; }

void GpuTimeline::clear() {
  anchors_.clear();
  first_anchor_ = 0;
  pending_.clear();
}

void GpuTimeline::anchor(GpuMarkPtr mark, int64_t host_us) {
  if (!mark) return;
  anchors_.push_back({std::move(mark), host_us});
}

bool GpuTimeline::add(std::string name, std::string category, const std::string& lane,
                      GpuMarkPtr start, GpuMarkPtr end, std::vector<Event>& resolved) {
  if (anchors_.empty() || !start || !end) return false;
  pending_.push_back({std::move(name), std::move(category), gpu_lane(lane), std::move(start),
                      std::move(end), first_anchor_ + anchors_.size() - 1});
  if (pending_.size() >= kResolveAt) resolve(/*wait=*/false, resolved);
  return true;
}

int64_t GpuTimeline::to_host_us(const Anchor& anchor, GpuMark& mark) const {
  return anchor.host_us + std::llround(anchor.mark->milliseconds_to(mark) * 1000.0);
}

void GpuTimeline::resolve(bool wait, std::vector<Event>& out) {
  std::vector<Pending> left;
  size_t i = 0;
  try {
    for (; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      if (wait) {
        // The end first: on one stream the start is then reached already.
        p.end->synchronize();
        p.start->synchronize();
      } else if (!p.end->reached() || !p.start->reached()) {
        left.push_back(std::move(p));
        continue;
      }
      const Anchor& a = anchors_.at(p.anchor - first_anchor_);
      const int64_t start_us = to_host_us(a, *p.start);
      const int64_t end_us = to_host_us(a, *p.end);
      if (p.category == "wait" && end_us <= start_us) continue;  // no stall
      out.push_back({std::move(p.name), std::move(p.category), std::move(p.lane), start_us, end_us});
    }
  } catch (...) {
    // A device error: the spans not looked at yet stay pending, with the
    // ones left before.
    std::move(pending_.begin() + static_cast<std::ptrdiff_t>(i), pending_.end(),
              std::back_inserter(left));
    pending_ = std::move(left);
    throw;
  }
  pending_ = std::move(left);
  // Anchors no pending span converts against go, all but the latest: their
  // events return to the device's pool.
  uint64_t keep_from = first_anchor_ + (anchors_.empty() ? 0 : anchors_.size() - 1);
  for (const Pending& p : pending_) keep_from = std::min(keep_from, p.anchor);
  while (first_anchor_ < keep_from) {
    anchors_.pop_front();
    ++first_anchor_;
  }
}

}  // namespace hp::trace
