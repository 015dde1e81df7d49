#include "hp/distributed/collective_checks.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "hp/util/env.h"
#include "hp/util/error.h"

namespace hp::dist {
namespace {

std::atomic<bool>& checks_flag() {
  // "false" used to turn the checks on: anything but "0" did.
  static std::atomic<bool> flag{hp::env::get_bool("HP_CHECK_COLLECTIVES", false)};
  return flag;
}

// A fingerprint's op field as received from a peer, named.
const char* received_op_name(int64_t op) {
  return op >= 0 && op < kOpTypeCount ? op_name(static_cast<OpType>(op)) : "unknown";
}

constexpr int kFields = 6;

}  // namespace

bool collective_checks_enabled() { return checks_flag().load(std::memory_order_relaxed); }
void set_collective_checks(bool enabled) { checks_flag().store(enabled); }

void verify_same_call(Group& group, const CallFingerprint& mine) {
  if (group.size() == 1) return;
  const at::TensorOptions options = at::TensorOptions(at::kLong).device(group.device());
  at::Tensor local = at::tensor(
      std::vector<int64_t>{static_cast<int64_t>(mine.op), static_cast<int64_t>(mine.sequence),
                           mine.input_numel, mine.output_numel, mine.dtype, mine.extra},
      at::kLong).to(options.device());
  at::Tensor gathered = at::empty({group.size(), kFields}, options);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.size(); ++r) outputs[0].push_back(gathered[r]);
  std::vector<at::Tensor> inputs{local};
  group.process_group().allgather(outputs, inputs)->wait();
  at::Tensor all = gathered.cpu();

  auto rows = all.accessor<int64_t, 2>();
  bool same = true;
  for (int r = 1; r < group.size() && same; ++r) {
    for (int f = 0; f < kFields; ++f) same = same && rows[r][f] == rows[0][f];
  }
  if (same) return;
  std::string message = cat("collective mismatch on ", group.describe(),
                            ": the ranks issued different calls:");
  for (int r = 0; r < group.size(); ++r) {
    message += cat("\n  group rank ", r, " (global ", group.global_rank(r), "): ",
                   received_op_name(rows[r][0]), " #", rows[r][1], " input numel ", rows[r][2],
                   ", output numel ", rows[r][3], ", dtype ",
                   c10::toString(static_cast<at::ScalarType>(rows[r][4])), ", arg ",
                   rows[r][5]);
  }
  throw CollectiveError(message);
}

}  // namespace hp::dist
