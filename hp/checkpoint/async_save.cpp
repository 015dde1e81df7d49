#include "hp/checkpoint/async_save.h"

#include <ATen/ATen.h>

#include <chrono>
#include <iostream>
#include <numeric>

#include "hp/checkpoint/save_core.h"
#include "hp/dist/world.h"
#include "hp/util/error.h"

namespace hp::checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Checkpointers made in this process so far: each gets a group of its own,
// and every rank makes them in the same order, so the tags agree.
int g_checkpointers = 0;

// A staging buffer for `piece` in host memory: `kept` when it fits (same
// sizes, dtype and pinning), else a new one.
at::Tensor staging_for(const at::Tensor& piece, const at::Tensor& kept) {
  const bool pinned = !piece.is_cpu();
  if (kept.defined() && kept.sizes() == piece.sizes() &&
      kept.scalar_type() == piece.scalar_type() && kept.is_pinned() == pinned) {
    return kept;
  }
  return at::empty(piece.sizes(),
                   at::TensorOptions().dtype(piece.scalar_type()).pinned_memory(pinned));
}

}  // namespace

AsyncCheckpointer::AsyncCheckpointer() {
  const int serial = g_checkpointers++;
  if (!dist::is_initialized() || dist::get_world_size() == 1) return;
  std::vector<int> everyone(static_cast<size_t>(dist::get_world_size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  dist::GroupOptions options;
  options.tag = "checkpoint-" + std::to_string(serial);
  group_ = dist::new_group(everyone, options);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  join();
  if (failure_) {
    try {
      std::rethrow_exception(failure_);
    } catch (const std::exception& e) {
      std::cerr << "hp::checkpoint::AsyncCheckpointer: a save failed and no call raised it: "
                << exception_message(e) << std::endl;
    } catch (...) {
      std::cerr << "hp::checkpoint::AsyncCheckpointer: a save failed and no call raised it"
                << std::endl;
    }
  }
}

void AsyncCheckpointer::join() {
  if (writer_.joinable()) writer_.join();
}

SaveResult AsyncCheckpointer::wait() {
  join();
  if (failure_) {
    std::exception_ptr failure = failure_;
    failure_ = nullptr;
    std::rethrow_exception(failure);
  }
  return result_;
}

void AsyncCheckpointer::save(const State& state, const std::string& root, int64_t step,
                             const SaveOptions& options) {
  const Clock::time_point called = Clock::now();
  wait();  // the previous save, and its failure
  const Clock::time_point start = Clock::now();
  SavePlan plan = plan_save(state, root, step, group_.get());

  // The snapshot, complete before save() returns: training may change the
  // live pieces from then on.
  staging_.resize(plan.owned.size());
  std::vector<at::Tensor> pieces;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < plan.owned.size(); ++i) {
      const at::Tensor live = state.entries()[plan.owned[i]].local.detach();
      staging_[i] = staging_for(live, staging_[i]);
      staging_[i].copy_(live);
      pieces.push_back(staging_[i]);
    }
  }
  result_ = SaveResult{};
  result_.stall_seconds = seconds_since(called);

  // The staging buffers are not touched again before join(): the next save()
  // joins first.
  const double stall = result_.stall_seconds;
  writer_ = std::thread([this, plan = std::move(plan), pieces = std::move(pieces), options,
                         group = group_, start, stall] {
    try {
      SaveResult result = write_save(plan, pieces, options, group.get(), start);
      result.stall_seconds = stall;
      result_ = std::move(result);
    } catch (...) {
      failure_ = std::current_exception();
    }
  });
}

uint64_t AsyncCheckpointer::staging_bytes() const {
  uint64_t bytes = 0;
  for (const at::Tensor& t : staging_) bytes += t.defined() ? t.nbytes() : 0;
  return bytes;
}

}  // namespace hp::checkpoint
