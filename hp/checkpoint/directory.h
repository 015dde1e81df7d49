// The directories of a checkpoint root and the commit protocol on them
// (C4 in docs/features.md; the layout is drawn in checkpoint.h). Rank 0
// runs these; the other ranks only write files into the prepared directory.
#pragma once

#include <cstdint>
#include <string>

namespace hp::checkpoint {

inline constexpr const char* kMetadataFile = "metadata.json";

// ROOT/.tmp-step-N, where a save of step N writes before its commit.
std::string temp_dir(const std::string& root, int64_t step);
// Makes temp_dir(root, step) exist and be empty (a leftover of a crashed
// save is removed), creating ROOT when missing.
void prepare_temp_dir(const std::string& root, int64_t step);

// "rank-00003.safetensors".
std::string rank_file_name(int rank);

// Makes `temp` (complete, its files durable) the checkpoint ROOT/step-N: a
// checkpoint already there is moved aside first and removed after, then
// ROOT is fsynced. Returns the final path.
std::string commit_dir(const std::string& root, const std::string& temp, int64_t step);

}  // namespace hp::checkpoint
