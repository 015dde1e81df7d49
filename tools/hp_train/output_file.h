// hp-train's output files (--log-json, --trace).
#pragma once

#include <fstream>
#include <string>

namespace hp::train {

// Creates `path`'s folder when missing and opens the file for writing
// (truncated). Throws hp::ArgumentError naming `flag` and the path when it
// cannot be opened. Called before any collective, so a bad path ends every
// rank at the start of a run rather than after its last step.
std::ofstream open_output_file(const std::string& flag, const std::string& path);

// --trace's file for `rank`: "out/trace.json" -> "out/trace.rank1.json".
std::string trace_path(const std::string& path, int rank);

}  // namespace hp::train
