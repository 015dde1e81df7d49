// How the facade averages over a group where the backend reduces the dtype
// itself, in that dtype (NCCL: fp32, bf16 and fp16 natively, as FSDP2 has
// them), instead of the facade summing in fp32 (Gloo, the shared-memory
// channel).
//
// fp16's range is the problem: the sum of N fp16 values overflows at 65504
// where their average may not. So fp16 is divided by `pre` before the sum
// and the result by `post` after (pre * post = N), pre the largest power of
// two with pre * pre <= N that divides N: the division before is exact for
// normal values (a power of two), the sum's partial sums stay within post
// times the largest average, and one rounding is added after. This is
// FSDP2's pre/post division; it widens fp16's safe range by `pre` (2 on 4
// or 8 ranks, 4 on 16), it does not remove the limit. Every other dtype
// uses the backend's own average (NCCL's AVG: a premultiplied sum).
//
// The arithmetic, and the rounding bounds of the native sums, are checked
// on the CPU through Gloo's own bf16 and fp16 sums
// (tests/distributed/low_precision_test.cpp).
#pragma once

#include <c10/core/ScalarType.h>

namespace hp::dist {

struct NativeAverage {
  bool backend_average = true;  // the backend's own AVG; else pre and post
  int pre = 1;                  // inputs divided by this before a sum
  int post = 1;                 // and the sum by this after; pre * post = group size
};

// `group_size` >= 1.
NativeAverage native_average(c10::ScalarType dtype, int group_size);

}  // namespace hp::dist
