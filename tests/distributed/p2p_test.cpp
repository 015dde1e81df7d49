// Point-to-point ops of the facade (p2p.h) on the world group: a ring
// exchange in several dtypes, the 1F1B batch (a forward send and a
// backward receive together), ordering to one peer, the argument checks
// before the wire, the numbering apart from the collective sequence, a
// timed-out receive's message, and (with HP_CHECK_COLLECTIVES) a shape
// mismatch that fails both ends. Run on 2, 3 and 4 ranks, and on 3 through
// Gloo alone. Every value is derived from ranks, so each rank knows what
// it must receive.
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "hp/distributed/collective_checks.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/p2p.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"

namespace hp::dist {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::tensors_equal;

// What rank `from` sends in transfer `k` (distinct per rank and transfer).
at::Tensor p2p_payload(int from, int k, at::ScalarType dtype, at::IntArrayRef shape = {3, 5}) {
  at::Tensor t =
      at::arange(c10::multiply_integers(shape), at::kLong).view(shape) + 100 * from + 7 * k;
  if (dtype == at::kBool) return (t % 3) == 0;
  return t.to(dtype);
}

int next_rank(const Group& g) { return (g.rank() + 1) % g.size(); }
int prev_rank(const Group& g) { return (g.rank() + g.size() - 1) % g.size(); }

class P2PDtypes : public testing::TestWithParam<at::ScalarType> {};

INSTANTIATE_TEST_SUITE_P(Dtypes, P2PDtypes,
                         testing::Values(at::kFloat, at::kBFloat16, at::kLong, at::kBool),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

// Each rank sends to the next and receives from the previous; both are
// issued before either is waited for.
TEST_P(P2PDtypes, RingExchange) {
  Group& g = *world_group();
  const at::ScalarType dtype = GetParam();
  at::Tensor out = p2p_payload(g.rank(), 0, dtype);
  at::Tensor in = at::zeros({3, 5}, dtype);
  Work sent = send(g, out, next_rank(g));
  Work received = recv(g, in, prev_rank(g));
  received.wait();
  sent.wait();
  EXPECT_TRUE(tensors_equal(in, p2p_payload(prev_rank(g), 0, dtype)));
  EXPECT_TRUE(received.is_completed());
}

// The 1F1B pattern on a line of stages: each batch holds a forward send to
// the next stage with the backward receive from it, and the backward send
// to the previous stage with the forward receive from it.
TEST(P2P, BatchWithBothDirectionsToBothNeighbours) {
  Group& g = *world_group();
  const int r = g.rank(), n = g.size();
  at::Tensor activation_in = at::zeros({2, 4}), grad_in = at::zeros({4}, at::kBFloat16);
  std::vector<P2PRequest> requests;
  if (r + 1 < n) {
    requests.push_back({P2POp::kSend, p2p_payload(r, 1, at::kFloat, {2, 4}), r + 1});
    requests.push_back({P2POp::kRecv, grad_in, r + 1});
  }
  if (r > 0) {
    requests.push_back({P2POp::kSend, p2p_payload(r, 2, at::kBFloat16, {4}), r - 1});
    requests.push_back({P2POp::kRecv, activation_in, r - 1});
  }
  std::vector<Work> works = batch_p2p(g, requests);
  ASSERT_EQ(works.size(), requests.size());
  for (Work& w : works) w.wait();
  if (r > 0) {
    EXPECT_TRUE(tensors_equal(activation_in, p2p_payload(r - 1, 1, at::kFloat, {2, 4})));
  }
  if (r + 1 < n) {
    EXPECT_TRUE(tensors_equal(grad_in, p2p_payload(r + 1, 2, at::kBFloat16, {4})));
  }
}

// Several sends to one peer arrive in the order they were issued, however
// the receiver waits for them; so do those of one batch.
TEST(P2P, SendsToOnePeerArriveInOrder) {
  Group& g = *world_group();
  constexpr int kCount = 5;
  if (g.rank() == 0) {
    std::vector<Work> works;
    for (int k = 0; k < kCount; ++k) works.push_back(send(g, p2p_payload(0, k, at::kInt), 1));
    std::vector<P2PRequest> batch;
    for (int k = kCount; k < 2 * kCount; ++k) {
      batch.push_back({P2POp::kSend, p2p_payload(0, k, at::kInt), 1});
    }
    for (Work& w : batch_p2p(g, batch)) works.push_back(w);
    for (Work& w : works) w.wait();
  } else if (g.rank() == 1) {
    std::vector<at::Tensor> in;
    std::vector<Work> works;
    for (int k = 0; k < 2 * kCount; ++k) {
      in.push_back(at::zeros({3, 5}, at::kInt));
      works.push_back(recv(g, in.back(), 0));
    }
    for (int k = 2 * kCount - 1; k >= 0; --k) works[k].wait();
    for (int k = 0; k < 2 * kCount; ++k) {
      EXPECT_TRUE(tensors_equal(in[k], p2p_payload(0, k, at::kInt))) << "transfer " << k;
    }
  }
  barrier(g).wait();
}

// Tags separate streams of transfers between the same two ranks (Gloo).
TEST(P2P, TagsPairSeparately) {
  Group& g = *world_group();
  if (g.rank() == 0) {
    Work a = send(g, p2p_payload(0, 1, at::kFloat), 1, /*tag=*/1);
    Work b = send(g, p2p_payload(0, 2, at::kFloat), 1, /*tag=*/2);
    a.wait();
    b.wait();
  } else if (g.rank() == 1) {
    at::Tensor two = at::zeros({3, 5}), one = at::zeros({3, 5});
    Work b = recv(g, two, 0, /*tag=*/2);
    Work a = recv(g, one, 0, /*tag=*/1);
    b.wait();
    a.wait();
    EXPECT_TRUE(tensors_equal(one, p2p_payload(0, 1, at::kFloat)));
    EXPECT_TRUE(tensors_equal(two, p2p_payload(0, 2, at::kFloat)));
  }
  barrier(g).wait();
}

TEST(P2P, ArgumentErrorsBeforeTheWire) {
  Group& g = *world_group();
  const int n = g.size(), me = g.rank(), peer = next_rank(g);
  const uint64_t sends = p2p_sequence_number(g, peer, P2POp::kSend);
  const uint64_t collectives = g.sequence_number();
  EXPECT_THAT([&] { send(g, at::ones({2}), n); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "send: peer " + std::to_string(n) + " is not a group rank of group 'world'")));
  EXPECT_THAT([&] { recv(g, at::ones({2}), -1); },
              ThrowsMessage<ArgumentError>(HasSubstr("recv: peer -1 is not a group rank")));
  EXPECT_THAT([&] { send(g, at::ones({2}), me); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "send: peer " + std::to_string(me) + " is this rank's own group rank")));
  EXPECT_THAT([&] { send(g, at::ones({4, 3}).t(), peer); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("send: tensor [3, 4] Float"),
                                                 HasSubstr("must be contiguous"))));
  EXPECT_THAT([&] { recv(g, at::empty({2}, at::TensorOptions().device(at::kMeta)), peer); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("recv: tensor is on meta"),
                                                 HasSubstr("expected a CPU or CUDA tensor"))));
  EXPECT_THAT([&] { send(g, at::ones({2}), peer, -3); },
              ThrowsMessage<ArgumentError>(HasSubstr("send: tag -3 is out of range")));
  EXPECT_THAT([&] { recv(g, at::ones({2}), peer, kMaxP2PTag + 1); },
              ThrowsMessage<ArgumentError>(HasSubstr("expected 0 <= tag <= " +
                                                     std::to_string(kMaxP2PTag))));
  EXPECT_THAT([&] { send(g, at::Tensor(), peer); },
              ThrowsMessage<ArgumentError>(HasSubstr("send: tensor is an undefined tensor")));
  // A bad request anywhere in a batch: nothing of it is issued.
  EXPECT_THAT(
      [&] {
        batch_p2p(g, {{P2POp::kSend, at::ones({2}), peer}, {P2POp::kRecv, at::ones({2}), me}});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("recv: peer " + std::to_string(me))));
  EXPECT_EQ(p2p_sequence_number(g, peer, P2POp::kSend), sends);
  EXPECT_EQ(g.sequence_number(), collectives);
  // Nothing reached the wire: the ring still pairs.
  at::Tensor in = at::zeros({3, 5});
  Work s = send(g, p2p_payload(me, 0, at::kFloat), peer);
  recv(g, in, prev_rank(g)).wait();
  s.wait();
  EXPECT_TRUE(tensors_equal(in, p2p_payload(prev_rank(g), 0, at::kFloat)));
}

// Ranks issue different numbers of point-to-point ops: they are numbered
// per peer and direction, not by the collective sequence number; comm_stats
// counts them.
TEST(P2P, NumberedPerPeerNotByTheCollectiveSequence) {
  Group& g = *world_group();
  const int next = next_rank(g), prev = prev_rank(g);
  const uint64_t collectives = g.sequence_number();
  const uint64_t sends = p2p_sequence_number(g, next, P2POp::kSend);
  const uint64_t recvs = p2p_sequence_number(g, prev, P2POp::kRecv);
  const CommStats before = comm_stats();
  at::Tensor in = at::zeros({3, 5});
  Work s = send(g, p2p_payload(g.rank(), 0, at::kFloat), next);
  recv(g, in, prev).wait();
  s.wait();
  EXPECT_EQ(g.sequence_number(), collectives);
  EXPECT_EQ(p2p_sequence_number(g, next, P2POp::kSend), sends + 1);
  EXPECT_EQ(p2p_sequence_number(g, prev, P2POp::kRecv), recvs + 1);
  const CommStats delta = comm_stats() - before;
  EXPECT_EQ(delta[OpType::kSend], 1);
  EXPECT_EQ(delta[OpType::kRecv], 1);
  EXPECT_EQ(delta.total(), 2) << delta.describe_calls();
  // Only rank 0 sends more: the collective after still meets.
  if (g.rank() == 0) {
    for (int k = 0; k < 3; ++k) send(g, p2p_payload(0, k, at::kFloat), 1).wait();
  } else if (g.rank() == 1) {
    for (int k = 0; k < 3; ++k) recv(g, in, 0).wait();
  }
  at::Tensor one = at::ones({1});
  all_reduce(g, one).wait();
  EXPECT_EQ(one.item<float>(), float(g.size()));
  EXPECT_EQ(g.sequence_number(), collectives + 1);
}

// A receive nobody answers ends at the group's timeout, naming the op, the
// peer's global rank, the bytes, the tensor and the p2p number. (A Gloo
// timeout breaks its group: a group of its own.)
TEST(P2P, TimedOutReceiveNamesPeerBytesAndNumber) {
  std::vector<int> all;
  for (int r = 0; r < get_world_size(); ++r) all.push_back(r);
  GroupPtr g = new_group(all, {"p2p-timeout-test", std::chrono::milliseconds(1500)});
  if (g->rank() == 0) {
    at::Tensor in = at::zeros({4});
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THAT([&] { recv(*g, in, 1).wait(); },
                ThrowsMessage<CollectiveError>(AllOf(
                    HasSubstr("recv failed on group 'world#p2p-timeout-test'"),
                    HasSubstr("peer global rank 1, group rank 1"),
                    HasSubstr("p2p sequence number 0 from that peer"),
                    HasSubstr("timeout 1500 ms"), HasSubstr("16 bytes, tensor [4] Float"))));
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 30.0);
  }
  barrier(*world_group()).wait();
}

// Turns the checks on for one test, and off again however it ends.
struct P2PChecksOn {
  P2PChecksOn() { set_collective_checks(true); }
  ~P2PChecksOn() { set_collective_checks(false); }
};

// With the checks on, a shape mismatch of equal byte counts fails on both
// ends, each naming both shapes; the ends stay paired for the next transfer.
TEST(P2P, ChecksReportAMismatchOnBothEnds) {
  Group& g = *world_group();
  P2PChecksOn checks;
  if (g.rank() == 0) {
    EXPECT_THAT([&] { send(g, p2p_payload(0, 0, at::kFloat, {2, 3}), 1).wait(); },
                ThrowsMessage<CollectiveError>(AllOf(
                    HasSubstr("send failed on group 'world'"),
                    HasSubstr("this rank sends [2, 3] Float (24 bytes, p2p sequence number"),
                    HasSubstr("group rank 1 (global 1) expects [3, 2] Float"))));
    EXPECT_THAT([&] { send(g, at::ones({4}, at::kInt), 1).wait(); },
                ThrowsMessage<CollectiveError>(
                    AllOf(HasSubstr("sends [4] Int"), HasSubstr("expects [4] Float"))));
    send(g, p2p_payload(0, 3, at::kFloat), 1).wait();
  } else if (g.rank() == 1) {
    at::Tensor in = at::zeros({3, 2});
    EXPECT_THAT([&] { recv(g, in, 0).wait(); },
                ThrowsMessage<CollectiveError>(AllOf(
                    HasSubstr("recv failed on group 'world'"),
                    HasSubstr("group rank 0 (global 0) sends [2, 3] Float (24 bytes"),
                    HasSubstr("this rank expects [3, 2] Float"))));
    EXPECT_TRUE(tensors_equal(in, at::zeros({3, 2}))) << "a mismatched payload is drained";
    EXPECT_THROW(recv(g, at::zeros({4}), 0).wait(), CollectiveError);
    at::Tensor next = at::zeros({3, 5});
    recv(g, next, 0).wait();
    EXPECT_TRUE(tensors_equal(next, p2p_payload(0, 3, at::kFloat)));
  }
  // The checked ring, for every rank.
  at::Tensor in = at::zeros({3, 5}, at::kBFloat16);
  Work s = send(g, p2p_payload(g.rank(), 4, at::kBFloat16), next_rank(g));
  recv(g, in, prev_rank(g)).wait();
  s.wait();
  EXPECT_TRUE(tensors_equal(in, p2p_payload(prev_rank(g), 4, at::kBFloat16)));
  barrier(g).wait();
}

}  // namespace
}  // namespace hp::dist
