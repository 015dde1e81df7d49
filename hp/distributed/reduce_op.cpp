#include "hp/distributed/reduce_op.h"

#include "hp/util/error.h"

namespace hp::dist {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& name, const char* argument) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg") return ReduceOp::kAvg;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  throw_argument_error(cat(argument, " must be one of ['sum', 'avg', 'max', 'min'] but got '",
                           name, "'"));
}

}  // namespace hp::dist
