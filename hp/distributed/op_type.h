// The kinds of collective the facade issues, in c10d's vocabulary (its
// OpType): one enum for counting them (comm_stats.h), fingerprinting them
// (collective_checks.h) and naming them in messages and reports. Sends and
// receives (p2p.h) are counted here too, one per op; they are never
// fingerprinted (ranks issue different numbers of them).
#pragma once

#include <array>
#include <cstdint>

namespace hp::dist {

enum class OpType : int64_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
};
inline constexpr int kOpTypeCount = 8;
inline constexpr std::array<OpType, kOpTypeCount> kOpTypes = {
    OpType::kAllGather, OpType::kReduceScatter, OpType::kAllReduce, OpType::kBroadcast,
    OpType::kAllToAll,  OpType::kBarrier,       OpType::kSend,      OpType::kRecv};

// "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all",
// "barrier", "send", "recv" (the keys of hp-bench's collective counts).
const char* op_name(OpType op);

}  // namespace hp::dist
