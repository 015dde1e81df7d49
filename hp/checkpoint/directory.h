// The directories of a checkpoint root and the commit protocol on them
// (C4 in docs/features.md; the layout is drawn in checkpoint.h). Rank 0
// runs these; the other ranks only write files into the prepared directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::checkpoint {

inline constexpr const char* kMetadataFile = "metadata.json";

// ROOT/.tmp-step-N, where a save of step N writes before its commit.
std::string temp_dir(const std::string& root, int64_t step);
// Makes temp_dir(root, step) exist and be empty (a leftover of a crashed
// save is removed), creating ROOT when missing.
void prepare_temp_dir(const std::string& root, int64_t step);

// "rank-00003.safetensors".
std::string rank_file_name(int rank);

// ROOT/.old-step-N, where the two-rename replace below keeps the replaced
// checkpoint between its renames.
std::string old_dir(const std::string& root, int64_t step);

// Makes `temp` (complete, its files durable) the checkpoint ROOT/step-N,
// then fsyncs ROOT. Returns the final path. A checkpoint already there is
// replaced atomically where the kernel and file system allow it: one
// renameat2(RENAME_EXCHANGE) swaps the two directories (a crash leaves
// either the old or the new step-N, and the replaced one under the temp
// name, which recover_leftovers removes), then the replaced one is removed.
// Where exchange is not supported (NFS, other kernels), POSIX has no atomic
// replace of a non-empty directory: step-N is renamed to ROOT/.old-step-N,
// then temp to step-N; a failure of the second rename renames .old-step-N
// back, and a crash between the two leaves .old-step-N and no step-N, which
// loads still find (complete_checkpoints) and recover_leftovers renames back.
std::string commit_dir(const std::string& root, const std::string& temp, int64_t step);

// What a crashed or failed save left in ROOT, made right (rank 0, holding
// ROOT's lock, root_lock.h): every .old-step-N becomes step-N again when
// step-N is missing and is removed when it exists; with `remove_temps`
// (when this process has just taken the lock, so no save of its own is in
// flight and no other job's can be) every .tmp-step-N directory goes too.
// Returns one line per change, for stderr. Raises CheckpointError naming
// the directory when a rename or removal fails.
std::vector<std::string> recover_leftovers(const std::string& root, bool remove_temps);

// A checkpoint a load can read, and the directory it is in.
struct CheckpointDir {
  int64_t step = 0;
  std::string path;
};

// The complete checkpoints in ROOT, newest first: each step-N directory
// (a real directory, no link) holding metadata.json, and each .old-step-N
// holding one whose step-N is missing (a replace that crashed between its
// renames: that is then step N's checkpoint). Empty when ROOT holds none or
// is not a directory. Raises CheckpointError for a step beyond INT64_MAX.
std::vector<CheckpointDir> complete_checkpoints(const std::string& root);

}  // namespace hp::checkpoint
