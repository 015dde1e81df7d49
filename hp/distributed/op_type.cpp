#include "hp/distributed/op_type.h"

namespace hp::dist {

const char* op_name(OpType op) {
  switch (op) {
    case OpType::kAllGather: return "all_gather";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kAllReduce: return "all_reduce";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAllToAll: return "all_to_all";
    case OpType::kBarrier: return "barrier";
    case OpType::kSend: return "send";
    case OpType::kRecv: return "recv";
  }
  return "unknown";
}

}  // namespace hp::dist
