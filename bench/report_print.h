// hp-bench's printed report (A2): the table of rows, the targets with their
// verdicts, the hook and dispatch overheads, and the checkpoint row, on
// stdout. Reads the report JSON only (its rows' names must be in bench/rows.h).
#pragma once

#include <nlohmann/json.hpp>

namespace hp::bench {

// The rows, targets, hook overhead and dispatch overhead of `report`.
void print_report(const nlohmann::json& report);

// The checkpoint row (summarize_checkpoint's result).
void print_checkpoint(const nlohmann::json& checkpoint);

}  // namespace hp::bench
