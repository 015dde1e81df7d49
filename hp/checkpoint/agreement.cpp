#include "hp/checkpoint/agreement.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>

#include "hp/checkpoint/errors.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::checkpoint {
namespace {

enum Kind : int64_t { kNone = 0, kArgument = 1, kCheckpoint = 2 };

[[noreturn]] void raise(int64_t kind, const std::string& message) {
  if (kind == kArgument) throw ArgumentError(message);
  throw CheckpointError(message);
}

// The group to agree over; nullptr when this process runs alone.
dist::Group* agreement_group(dist::Group* group) {
  if (!dist::is_initialized() || dist::get_world_size() == 1) return nullptr;
  return group != nullptr ? group : dist::world_group().get();
}

}  // namespace

void run_agreed(const std::function<void()>& fn, dist::Group* group) {
  int64_t kind = kNone;
  std::string message;
  try {
    fn();
  } catch (const ArgumentError& e) {
    kind = kArgument;
    message = e.what();
  } catch (const std::exception& e) {
    kind = kCheckpoint;
    message = exception_message(e);
  }
  dist::Group* const agreeing = agreement_group(group);
  if (agreeing == nullptr) {
    if (kind != kNone) raise(kind, message);
    return;
  }
  dist::Group& g = *agreeing;
  const int64_t size = g.size();
  at::Tensor first = at::full({1}, kind == kNone ? size : g.rank(), at::kLong);
  dist::all_reduce(g, first, dist::ReduceOp::kMin).wait();
  const int64_t source = first.item<int64_t>();
  if (source == size) return;
  at::Tensor head = at::tensor({kind, static_cast<int64_t>(message.size())}, at::kLong);
  dist::broadcast(g, head, static_cast<int>(source)).wait();
  const int64_t length = head[1].item<int64_t>();
  at::Tensor text = at::zeros({std::max<int64_t>(length, 1)}, at::kByte);
  if (g.rank() == source) std::memcpy(text.data_ptr(), message.data(), message.size());
  dist::broadcast(g, text, static_cast<int>(source)).wait();
  raise(head[0].item<int64_t>(),
        std::string(static_cast<const char*>(text.data_ptr()), static_cast<size_t>(length)));
}

bool same_on_every_rank(int64_t value, dist::Group* group) {
  dist::Group* const agreeing = agreement_group(group);
  if (agreeing == nullptr) return true;
  dist::Group& g = *agreeing;
  at::Tensor low = at::full({1}, value, at::kLong);
  at::Tensor high = at::full({1}, value, at::kLong);
  dist::all_reduce(g, low, dist::ReduceOp::kMin).wait();
  dist::all_reduce(g, high, dist::ReduceOp::kMax).wait();
  return low.item<int64_t>() == high.item<int64_t>();
}

void require_same_on_every_rank(int64_t value, const std::string& what,
                                const std::function<std::string(int64_t)>& describe,
                                dist::Group* group) {
  dist::Group* const agreeing = agreement_group(group);
  if (agreeing == nullptr) return;
  dist::Group& g = *agreeing;
  // Every rank's value, so every rank reaches the same verdict and message.
  at::Tensor mine = at::full({1}, value, at::kLong);
  at::Tensor all = at::empty({g.size()}, at::kLong);
  dist::all_gather_into(g, all, mine).wait();
  const int64_t* v = all.data_ptr<int64_t>();
  int low = 0, high = 0;
  for (int r = 1; r < g.size(); ++r) {
    if (v[r] < v[low]) low = r;
    if (v[r] > v[high]) high = r;
  }
  if (v[low] == v[high]) return;
  throw CheckpointError(cat(what, " differs between the ranks: rank ", low, " has ",
                            describe(v[low]), ", rank ", high, " has ", describe(v[high]),
                            "; every rank must see the same files (a network file system "
                            "that shows ranks different directories, or different paths "
                            "per rank)"));
}

}  // namespace hp::checkpoint
