#include "hp/checkpoint/async_save.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <chrono>
#include <iostream>
#include <numeric>

#include "hp/checkpoint/agreement.h"
#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/save_core.h"
#include "hp/distributed/world.h"
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

// Copies the live pieces into their staging buffers; returns the key of a
// piece whose version counter moved from `at_save` (changed in place since
// save() was called), or "".
std::string copy_pieces(const std::vector<at::Tensor>& live, const std::vector<uint32_t>& at_save,
                        const std::vector<std::string>& keys,
                        const std::vector<at::Tensor>& staging) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < live.size(); ++i) staging[i].copy_(live[i]);
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i]._version() != at_save[i]) return keys[i];
  }
  return "";
}

// The write (page-cache copies, checksums) is the one part of a save that
// nothing waits for, so it runs at the lowest CPU priority: on cores that
// training keeps busy it takes their idle moments instead of slowing the
// steps it overlaps. Linux's nice value is per thread; the staging copy,
// which the next optimizer step may wait for, has run already. Best
// effort: a failure leaves the priority as it was.
void yield_cpu_to_training() {
#if defined(__linux__)
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
#endif
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
                             const SaveOptions& options, Staging staging) {
  const Clock::time_point called = Clock::now();
  wait();  // the previous save, and its failure
  const Clock::time_point start = Clock::now();
  SavePlan plan = plan_save(state, root, step, group_.get());

  // The live pieces this rank writes, with their version counters now: an
  // in-place change moves a counter (views share their base's).
  std::vector<at::Tensor> live;
  std::vector<uint32_t> versions;
  staging_.resize(plan.owned.size());
  for (size_t i = 0; i < plan.owned.size(); ++i) {
    live.push_back(state.entries()[plan.owned[i]].local.detach());
    versions.push_back(live.back()._version());
    staging_[i] = staging_for(live.back(), staging_[i]);
  }
  std::vector<std::string> keys;
  for (size_t i : plan.owned) keys.push_back(plan.entries[i].key);
  std::promise<void> staged;
  staged_ = staged.get_future().share();
  const bool in_background = staging == Staging::kInBackground;
  if (!in_background) {
    // The caller holds the state still: nothing can change it meanwhile.
    staged.set_value();
    copy_pieces(live, versions, keys, staging_);
    live.clear();
  }
  result_ = SaveResult{};
  result_.stall_seconds = seconds_since(called);

  // The staging buffers are not touched again before join(): the next save()
  // joins first.
  const double stall = result_.stall_seconds;
  writer_ = std::thread([this, plan = std::move(plan), pieces = staging_, live = std::move(live),
                         versions = std::move(versions), staged = std::move(staged),
                         keys = std::move(keys), in_background, options, group = group_, start,
                         stall]() mutable {
    try {
      std::string changed;
      if (in_background) {
        try {
          if (options.before_staging) options.before_staging();
          changed = copy_pieces(live, versions, keys, pieces);
        } catch (...) {
          staged.set_value();
          throw;
        }
        live.clear();  // the live tensors are the caller's again
        staged.set_value();
      }
      yield_cpu_to_training();
      run_agreed(
          [&] {
            if (changed.empty()) return;
            throw CheckpointError("checkpoint::AsyncCheckpointer: tensor '" + changed +
                                  "' changed while the save of step " +
                                  std::to_string(plan.step) +
                                  " copied it (Staging::kInBackground): call "
                                  "wait_for_staging() before changing the state");
          },
          group.get());
      SaveResult result = write_save(plan, pieces, options, group.get(), start);
      result.stall_seconds = stall;
      result_ = std::move(result);
    } catch (...) {
      failure_ = std::current_exception();
    }
  });
}

void AsyncCheckpointer::wait_for_staging() {
  if (staged_.valid()) staged_.wait();
}

uint64_t AsyncCheckpointer::staging_bytes() const {
  uint64_t bytes = 0;
  for (const at::Tensor& t : staging_) bytes += t.defined() ? t.nbytes() : 0;
  return bytes;
}

}  // namespace hp::checkpoint
