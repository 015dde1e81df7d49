// Reduction operators of the collectives facade.
//
// Gloo 1.13 has no AVG: the facade implements kAvg as a sum followed by a
// division by the group size, on the receiving side.
#pragma once

#include <string>

#include "hp/util/format.h"

namespace hp::dist {

// The vector overloads of hp::to_string stay visible next to ours.
using hp::to_string;

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// "sum", "avg", "max", "min".
const char* to_string(ReduceOp op);

// Parses one of the names above; anything else raises ArgumentError naming
// `argument`, the value and the accepted names.
ReduceOp parse_reduce_op(const std::string& name, const char* argument = "reduce_op");

}  // namespace hp::dist
