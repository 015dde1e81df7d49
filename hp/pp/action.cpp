#include "hp/pp/action.h"

#include <array>
#include <charconv>
#include <ostream>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::pp {

namespace {

struct OpName {
  Op op;
  std::string_view name;
};

// Longest names first: parse_action takes the first name the text continues
// with, and "SEND_F" must not be read as an "S..." prefix of something shorter.
constexpr std::array<OpName, 11> kOpNames = {{
    {Op::kReduceGrad, "REDUCE_GRAD"},
    {Op::kUnshard, "UNSHARD"},
    {Op::kReshard, "RESHARD"},
    {Op::kSendF, "SEND_F"},
    {Op::kRecvF, "RECV_F"},
    {Op::kSendB, "SEND_B"},
    {Op::kRecvB, "RECV_B"},
    {Op::kForward, "F"},
    {Op::kBackward, "B"},
    {Op::kBackwardInput, "I"},
    {Op::kBackwardWeight, "W"},
}};

constexpr const char* kActionSyntax =
    "expected <stage><op><microbatch> as PyTorch writes actions (2F0, 1SEND_B3; no micro-batch for "
    "0UNSHARD, 0RESHARD, 0REDUCE_GRAD), op one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, "
    "UNSHARD, RESHARD, REDUCE_GRAD";

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string_view trim_blanks(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) {
    text.remove_suffix(1);
  }
  return text;
}

// The leading digits of `text` as an int; false when there are none or the
// number does not fit.
bool take_number(std::string_view& text, int& value) {
  size_t digits = 0;
  while (digits < text.size() && is_digit(text[digits])) ++digits;
  if (digits == 0) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (ec != std::errc() || end != text.data() + digits) return false;
  text.remove_prefix(digits);
  return true;
}

}  // namespace

const char* to_string(Op op) {
  for (const OpName& entry : kOpNames) {
    if (entry.op == op) return entry.name.data();
  }
  return "?";
}

bool is_compute(Op op) {
  return op == Op::kForward || op == Op::kBackward || op == Op::kBackwardInput ||
         op == Op::kBackwardWeight;
}

bool is_input_backward(Op op) { return op == Op::kBackward || op == Op::kBackwardInput; }

bool is_stage_wide(Op op) {
  return op == Op::kUnshard || op == Op::kReshard || op == Op::kReduceGrad;
}

bool operator==(const Action& a, const Action& b) {
  return a.stage == b.stage && a.op == b.op && a.microbatch == b.microbatch;
}

bool operator!=(const Action& a, const Action& b) { return !(a == b); }

std::ostream& operator<<(std::ostream& out, const Action& action) {
  return out << to_string(action);
}

std::string to_string(const Action& action) {
  if (is_stage_wide(action.op)) return cat(action.stage, to_string(action.op));
  return cat(action.stage, to_string(action.op), action.microbatch);
}

Action parse_action(std::string_view text) {
  std::string_view rest = trim_blanks(text);
  Action action{0, Op::kForward, -1};
  if (!take_number(rest, action.stage)) {
    throw ArgumentError(
        cat("parse_action: '", text, "' does not start with a stage number: ", kActionSyntax));
  }
  bool named = false;
  for (const OpName& entry : kOpNames) {
    if (rest.substr(0, entry.name.size()) == entry.name) {
      action.op = entry.op;
      rest.remove_prefix(entry.name.size());
      named = true;
      break;
    }
  }
  if (!named) {
    throw ArgumentError(cat("parse_action: '", text, "' names no known op after stage ",
                            action.stage, ": ", kActionSyntax));
  }
  if (is_stage_wide(action.op)) {
    if (!rest.empty()) {
      throw ArgumentError(cat("parse_action: '", text, "': ", to_string(action.op),
                              " acts on the whole stage and takes no micro-batch, got '", rest,
                              "'"));
    }
    return action;
  }
  if (!take_number(rest, action.microbatch) || !rest.empty()) {
    throw ArgumentError(cat("parse_action: '", text, "': ", to_string(action.op),
                            " needs a micro-batch number and nothing after it: ", kActionSyntax));
  }
  return action;
}

std::string to_csv(const Rows& rows) {
  std::string out;
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (i > 0) out += ',';
      out += to_string(row[i]);
    }
    out += '\n';
  }
  return out;
}

Rows parse_csv(std::string_view text) {
  Rows rows;
  size_t line_number = 0;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
    ++line_number;
    auto& row = rows.emplace_back();
    size_t cell_number = 0;
    while (true) {
      size_t comma = line.find(',');
      std::string_view cell = trim_blanks(line.substr(0, comma));
      ++cell_number;
      if (!cell.empty()) {
        try {
          row.push_back(parse_action(cell));
        } catch (const ArgumentError& e) {
          throw ArgumentError(cat("parse_csv: line ", line_number, " (rank ", line_number - 1,
                                  "), cell ", cell_number, ": ", e.what()));
        }
      }
      if (comma == std::string_view::npos) break;
      line.remove_prefix(comma + 1);
    }
  }
  return rows;
}

}  // namespace hp::pp
