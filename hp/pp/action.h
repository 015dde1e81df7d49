// One step of a pipeline-parallel schedule, as PyTorch's
// torch.distributed.pipelining writes it ("2F0": stage 2, forward,
// micro-batch 0), and a schedule's rows, one per pipeline rank.
//
// Pure values: no libtorch, no communication, no shared state; every function
// may be called from any thread. Bad text raises hp::ArgumentError naming it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

namespace hp::pp {

enum class Op : uint8_t {
  kForward,         // F: one stage's forward of one micro-batch
  kBackward,        // B: its full backward (input and weight gradients)
  kBackwardInput,   // I: the input gradient only (zero-bubble schedules)
  kBackwardWeight,  // W: the weight gradient, after the I of the same micro-batch
  kSendF,           // SEND_F: a forward's output to the next stage's rank
  kRecvF,           // RECV_F: a stage's input from the previous stage's rank
  kSendB,           // SEND_B: a backward's input gradient to the previous stage's rank
  kRecvB,           // RECV_B: a stage's output gradient from the next stage's rank
  kUnshard,         // UNSHARD: gather the stage's fully_shard parameters
  kReshard,         // RESHARD: free them again
  kReduceGrad,      // REDUCE_GRAD: reduce the stage's gradients, once per step
};

// The op's spelling in PyTorch's action text: "F", "SEND_F", "REDUCE_GRAD", ...
const char* to_string(Op op);

// F, B, I and W: the ops a compute-only schedule holds.
bool is_compute(Op op);
// B and I: the backwards that produce the stage's input gradient.
bool is_input_backward(Op op);
// UNSHARD, RESHARD and REDUCE_GRAD act on a whole stage: their microbatch is -1.
bool is_stage_wide(Op op);

struct Action {
  int stage;
  Op op;
  int microbatch;  // -1 for UNSHARD, RESHARD and REDUCE_GRAD
};

bool operator==(const Action& a, const Action& b);
bool operator!=(const Action& a, const Action& b);
// The text, so that test failures and logs read as schedules do.
std::ostream& operator<<(std::ostream& out, const Action& action);

// PyTorch's spelling: "2F0", "1B3", "0I1", "0W1", "1SEND_F3", "1RECV_B0",
// "0UNSHARD", "0REDUCE_GRAD".
std::string to_string(const Action& action);

// The inverse of to_string, surrounding blanks ignored. The whole text must be
// one action: <stage><op><microbatch>, the micro-batch absent exactly for the
// stage-wide ops. PyTorch's other ops (WAIT_SEND_F, OVERLAP_F_B, ...) are not
// part of this vocabulary and are refused as well.
Action parse_action(std::string_view text);

// A schedule: rows[r] is what pipeline rank r runs, in order.
using Rows = std::vector<std::vector<Action>>;

// One line per rank, actions separated by commas ("0F0,0F1,0B0\n1F0,..."),
// every line ending in '\n'; a rank with no actions is an empty line.
std::string to_csv(const Rows& rows);
// The inverse of to_csv. Also takes what PyTorch's _dump_csv writes: blanks
// around cells, empty cells (PyTorch's idle steps, dropped), "\r\n" endings.
// Errors name the line (= rank) and the cell.
Rows parse_csv(std::string_view text);

}  // namespace hp::pp
