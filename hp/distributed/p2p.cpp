// Point-to-point ops (p2p.h): checked here, then issued on c10d's send and
// recv, on Gloo (host path, with the optional header checks) or NCCL
// (stream path, a batch coalesced where this libtorch can).
#include "hp/distributed/p2p.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <array>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"
#include "hp/distributed/collective_checks.h"
#include "hp/distributed/p2p_state.h"
#include "hp/distributed/work_launch.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "hp/util/torch_compat.h"

namespace hp::dist {

namespace {

// A transferred tensor's shape and dtype, kept for a failure message
// without keeping the tensor alive: "64 bytes, tensor [4, 4] Float, tag 0".
struct P2PTransferDesc {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  int64_t bytes;
  int tag;
  std::string text() const {
    return cat(bytes, " bytes, tensor ", to_string(sizes), " ", dtype, ", tag ", tag);
  }
};

P2PTransferDesc describe_transfer(const P2PRequest& r) {
  return {r.tensor.sizes().vec(), r.tensor.scalar_type(), static_cast<int64_t>(r.tensor.nbytes()),
          r.tag};
}

void check_p2p_request(const Group& group, const P2PRequest& r) {
  const char* op = to_string(r.op);
  HP_CHECK_ARG(group.is_member(), op, ": this process is not a member of ", group.describe());
  HP_CHECK_ARG(r.peer >= 0 && r.peer < group.size(), op, ": peer ", r.peer,
               " is not a group rank of ", group.describe(), "; expected 0 <= peer < ",
               group.size());
  HP_CHECK_ARG(r.peer != group.rank(), op, ": peer ", r.peer, " is this rank's own group rank in ",
               group.describe(), "; expected another rank");
  HP_CHECK_ARG(r.tag >= 0 && r.tag <= kMaxP2PTag, op, ": tag ", r.tag,
               " is out of range; expected 0 <= tag <= ", kMaxP2PTag);
  HP_CHECK_ARG(r.tensor.defined(), op, ": tensor is an undefined tensor");
  HP_CHECK_ARG(r.tensor.layout() == at::kStrided, op, ": tensor has layout ", r.tensor.layout(),
               "; expected a dense (strided) tensor");
  HP_CHECK_ARG(r.tensor.is_contiguous(), op, ": tensor ", to_string(r.tensor.sizes().vec()), " ",
               r.tensor.scalar_type(), " with strides ", to_string(r.tensor.strides().vec()),
               " must be contiguous (the transport moves its bytes as one buffer)");
  if (group.backend_type() == BackendType::kNccl) {
    HP_CHECK_ARG(r.tensor.device() == group.device(), op, ": tensor is on ", r.tensor.device(),
                 " but ", group.describe(), " is an NCCL group on ", group.device(),
                 "; expected a tensor on ", group.device());
  } else {
    HP_CHECK_ARG(r.tensor.is_cpu() || r.tensor.is_cuda(), op, ": tensor is on ",
                 r.tensor.device(), " but ", group.describe(),
                 " is a Gloo group; expected a CPU or CUDA tensor");
  }
}

c10::intrusive_ptr<c10d::Work> post(c10d::ProcessGroup& pg, P2POp op, const at::Tensor& tensor,
                                    int peer, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  return op == P2POp::kSend ? pg.send(tensors, peer, tag) : pg.recv(tensors, peer, tag);
}

// Gloo's wait raises on a failure or timeout; a false return is one too.
void wait_for(c10d::Work& work, std::chrono::milliseconds timeout, const char* what) {
  if (!work.wait(timeout)) {
    throw std::runtime_error(cat(what, " timed out after ", timeout.count(), " ms"));
  }
}

// --- the checks' header: what the sender sends and the receiver expects ---

// Tags of the header (sender to receiver) and the answer (back), above
// every payload tag and apart from each other (c10d refuses negative tags).
int header_tag(int tag) { return (kMaxP2PTag + 1) + tag; }
int answer_tag(int tag) { return 2 * (kMaxP2PTag + 1) + tag; }

constexpr int kHeaderDims = 8;  // dims kept; more are compared through numel
constexpr int64_t kHeaderMagic = 0x68703270;  // "hp2p"

struct P2PHeader {
  std::array<int64_t, 5 + kHeaderDims> fields{};  // magic, sequence, dtype, ndim, numel, dims

  static P2PHeader of(const at::Tensor& t, uint64_t sequence) {
    P2PHeader h;
    h.fields[0] = kHeaderMagic;
    h.fields[1] = static_cast<int64_t>(sequence);
    h.fields[2] = static_cast<int64_t>(t.scalar_type());
    h.fields[3] = t.dim();
    h.fields[4] = t.numel();
    for (int64_t d = 0; d < t.dim() && d < kHeaderDims; ++d) h.fields[5 + d] = t.size(d);
    return h;
  }
  // A received header; raises if it is not one.
  static P2PHeader parse(const at::Tensor& received) {
    P2PHeader h;
    const int64_t* data = received.data_ptr<int64_t>();
    std::copy(data, data + h.fields.size(), h.fields.begin());
    const bool valid = h.fields[0] == kHeaderMagic && h.fields[2] >= 0 &&
                       h.fields[2] < static_cast<int64_t>(at::ScalarType::NumOptions) &&
                       h.fields[3] >= 0 && h.fields[4] >= 0;
    if (!valid) {
      throw std::runtime_error(
          "the peer's p2p header is malformed (is HP_CHECK_COLLECTIVES=1 set on every rank?)");
    }
    return h;
  }
  at::Tensor tensor() const {
    return at::tensor(std::vector<int64_t>(fields.begin(), fields.end()), at::kLong);
  }
  static at::Tensor buffer() { return at::empty({5 + kHeaderDims}, at::kLong); }

  at::ScalarType dtype() const { return static_cast<at::ScalarType>(fields[2]); }
  int64_t bytes() const { return fields[4] * static_cast<int64_t>(c10::elementSize(dtype())); }
  bool operator==(const P2PHeader& other) const { return fields == other.fields; }
  // "[2, 3] Float (24 bytes, p2p sequence number 4)"
  std::string text() const {
    const int64_t kept = std::min<int64_t>(fields[3], kHeaderDims);
    std::vector<int64_t> dims(fields.begin() + 5, fields.begin() + 5 + kept);
    std::string shape = to_string(dims);
    if (fields[3] > kHeaderDims) shape.insert(shape.size() - 1, ", ...");
    return cat(shape, " ", dtype(), " (", bytes(), " bytes, p2p sequence number ", fields[1], ")");
  }
};

// The sender's end of a checked transfer: the header, the payload and the
// receiver's answer go out at issue; the waiter raises on a mismatch once
// the payload is gone (the receiver drains it), so both ends stay paired.
detail::P2PWaiter checked_send(c10d::ProcessGroup& pg, const at::Tensor& wire,
                               const P2PHeader& mine, int peer, int peer_global, int tag) {
  auto header_work = post(pg, P2POp::kSend, mine.tensor(), peer, header_tag(tag));
  at::Tensor answer = P2PHeader::buffer();
  auto answer_work = post(pg, P2POp::kRecv, answer, peer, answer_tag(tag));
  c10::intrusive_ptr<c10d::Work> payload_work;
  if (mine.bytes() > 0) payload_work = post(pg, P2POp::kSend, wire, peer, tag);
  return [=](std::chrono::milliseconds timeout) {
    wait_for(*header_work, timeout, "the p2p header");
    wait_for(*answer_work, timeout, "the receiver's p2p header");
    const P2PHeader theirs = P2PHeader::parse(answer);
    if (payload_work) wait_for(*payload_work, timeout, "the payload");
    if (!(theirs == mine)) {
      throw CollectiveError(cat("p2p mismatch: this rank sends ", mine.text(), " but group rank ",
                                peer, " (global ", peer_global, ") expects ", theirs.text()));
    }
  };
}

// The receiver's end: the header's receive goes out at issue; a thread of
// its own waits for it, answers, and receives the payload (or drains it on
// a mismatch), so the sender's progress never waits for this rank's wait().
// Receives from one peer and tag post in issue order (P2PState).
detail::P2PWaiter checked_recv(Group& group, const at::Tensor& wire, const P2PHeader& mine,
                               int peer, int tag) {
  // The thread may outlive this call: it holds the process group itself.
  auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(
      &group.process_group());
  at::Tensor header = P2PHeader::buffer();
  auto header_work = post(*pg, P2POp::kRecv, header, peer, header_tag(tag));
  auto posted = std::make_shared<std::promise<void>>();
  std::shared_future<void> previous =
      group.p2p_state().exchange_posted(peer, tag, posted->get_future().share());
  const std::chrono::milliseconds timeout = group.timeout();
  const int peer_global = group.global_rank(peer);
  std::packaged_task<void()> task([=] {
    bool released = false;
    auto release = [&] {
      if (!released) posted->set_value();
      released = true;
    };
    try {
      wait_for(*header_work, timeout, "the sender's p2p header");
      if (previous.valid() && previous.wait_for(timeout) != std::future_status::ready) {
        throw std::runtime_error("the previous checked receive from this peer did not post");
      }
      const P2PHeader theirs = P2PHeader::parse(header);
      const bool same = theirs == mine;
      auto answer_work = post(*pg, P2POp::kSend, mine.tensor(), peer, answer_tag(tag));
      c10::intrusive_ptr<c10d::Work> payload_work;
      if (theirs.bytes() > 0) {
        at::Tensor into = same ? wire : at::empty({theirs.bytes()}, at::kByte);
        payload_work = post(*pg, P2POp::kRecv, into, peer, tag);
      }
      release();
      if (payload_work) wait_for(*payload_work, timeout, "the payload");
      wait_for(*answer_work, timeout, "the answer to the sender's p2p header");
      if (!same) {
        throw CollectiveError(cat("p2p mismatch: group rank ", peer, " (global ", peer_global,
                                  ") sends ", theirs.text(), " but this rank expects ",
                                  mine.text()));
      }
    } catch (...) {
      release();
      throw;
    }
  });
  std::shared_future<void> done = task.get_future().share();
  std::thread(std::move(task)).detach();
  return [done](std::chrono::milliseconds limit) {
    // Each step of the thread is bounded by the timeout; this bounds their sum.
    if (done.wait_for(4 * limit) != std::future_status::ready) {
      throw std::runtime_error(cat("the checked receive did not finish within ",
                                   (4 * limit).count(), " ms"));
    }
    done.get();
  };
}

// One op on Gloo: a CUDA tensor travels through a host copy (Gloo's
// transport takes the raw pointer); bytes of dtypes 1.13's Gloo refuses
// travel as a same-size type (wire_view).
Work gloo_p2p(Group& group, const P2PRequest& r, uint64_t sequence) {
  const bool send = r.op == P2POp::kSend;
  const bool staged = r.tensor.is_cuda();
  at::Tensor host = r.tensor;
  if (staged) {
    host = send ? r.tensor.cpu() : at::empty(r.tensor.sizes(), r.tensor.options().device(at::kCPU));
  }
  std::function<void()> finish;
  if (staged && !send) finish = [tensor = r.tensor, host] { tensor.copy_(host); };
  detail::P2PInfo info{to_string(r.op), [d = describe_transfer(r)] { return d.text(); }, r.peer,
                       sequence, r.tensor.device(), static_cast<int64_t>(r.tensor.nbytes()),
                       send ? 1 : 0, send ? 0 : 1};
  const bool checked = collective_checks_enabled();
  auto issue = [&]() -> detail::P2PWaiter {
    const at::Tensor wire = detail::wire_view(host);
    if (checked) {
      const P2PHeader mine = P2PHeader::of(r.tensor, sequence);
      if (send) {
        return checked_send(group.process_group(), wire, mine, r.peer,
                            group.global_rank(r.peer), r.tag);
      }
      return checked_recv(group, wire, mine, r.peer, r.tag);
    }
    if (r.tensor.numel() == 0) return nullptr;  // both ends skip it
    auto work = post(group.process_group(), r.op, wire, r.peer, r.tag);
    return [work](std::chrono::milliseconds timeout) { wait_for(*work, timeout, "the transfer"); };
  };
  return detail::launch_p2p(group, std::move(info), issue, std::move(finish));
}

Work nccl_p2p(Group& group, const P2PRequest& r, uint64_t sequence) {
  detail::P2PInfo info{to_string(r.op), [d = describe_transfer(r)] { return d.text(); }, r.peer,
                       sequence, r.tensor.device(), static_cast<int64_t>(r.tensor.nbytes()),
                       r.op == P2POp::kSend ? 1 : 0, r.op == P2POp::kRecv ? 1 : 0};
  return detail::launch_p2p_on_stream(group, std::move(info), [&group, &r] {
    return post(group.process_group(), r.op, r.tensor, r.peer, r.tag);
  });
}

Work issue_one(Group& group, const P2PRequest& r) {
  const uint64_t sequence = group.p2p_state().next(r.peer, r.op == P2POp::kSend);
  return group.backend_type() == BackendType::kNccl ? nccl_p2p(group, r, sequence)
                                                     : gloo_p2p(group, r, sequence);
}

}  // namespace

const char* to_string(P2POp op) { return op == P2POp::kSend ? "send" : "recv"; }

Work send(Group& group, const at::Tensor& tensor, int peer, int tag) {
  P2PRequest r{P2POp::kSend, tensor, peer, tag};
  check_p2p_request(group, r);
  return issue_one(group, r);
}

Work recv(Group& group, const at::Tensor& tensor, int peer, int tag) {
  P2PRequest r{P2POp::kRecv, tensor, peer, tag};
  check_p2p_request(group, r);
  return issue_one(group, r);
}

std::vector<Work> batch_p2p(Group& group, const std::vector<P2PRequest>& requests) {
  for (const P2PRequest& r : requests) check_p2p_request(group, r);
  std::vector<Work> works;
  if (requests.empty()) return works;
#if HP_TORCH_AT_LEAST(2, 11)
  if (group.backend_type() == BackendType::kNccl) {
    // One group call: every op is numbered, named in a failure, counted.
    std::string ops;
    int sends = 0, recvs = 0;
    int64_t bytes = 0;
    for (const P2PRequest& r : requests) {
      const bool send = r.op == P2POp::kSend;
      const uint64_t sequence = group.p2p_state().next(r.peer, send);
      ops += cat(ops.empty() ? "" : "; ", to_string(r.op), send ? " to" : " from", " group rank ",
                 r.peer, " (global ", group.global_rank(r.peer), ") #", sequence, " ",
                 describe_transfer(r).text());
      (send ? sends : recvs) += 1;
      bytes += static_cast<int64_t>(r.tensor.nbytes());
    }
    detail::P2PInfo info{"batch_p2p", [ops] { return cat("coalesced ", ops); }, -1, 0,
                         requests[0].tensor.device(), bytes, sends, recvs};
    c10d::ProcessGroup& pg = group.process_group();
    Work work = detail::launch_p2p_on_stream(group, std::move(info), [&pg, &requests] {
      pg.startCoalescing(c10::DeviceType::CUDA);
      try {
        for (const P2PRequest& r : requests) post(pg, r.op, r.tensor, r.peer, r.tag);
      } catch (...) {
        pg.endCoalescing(c10::DeviceType::CUDA);
        throw;
      }
      return pg.endCoalescing(c10::DeviceType::CUDA);
    });
    works.assign(requests.size(), work);
    return works;
  }
#endif
  works.reserve(requests.size());
  for (const P2PRequest& r : requests) works.push_back(issue_one(group, r));
  return works;
}

uint64_t p2p_sequence_number(const Group& group, int peer, P2POp op) {
  HP_CHECK_ARG(peer >= 0 && peer < group.size(), "p2p_sequence_number: peer ", peer,
               " is not a group rank of ", group.describe(), "; expected 0 <= peer < ",
               group.size());
  return group.p2p_state().count(peer, op == P2POp::kSend);
}

}  // namespace hp::dist
