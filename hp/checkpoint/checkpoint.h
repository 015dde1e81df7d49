// Sharded checkpoints (C1, C2, C4 in docs/features.md): every rank writes
// the pieces of a State it owns into its own safetensors file, rank 0 adds
// one metadata file (metadata.h), and a load on any mesh, world size or mode
// reads back only the saved chunks that overlap the pieces each rank holds.
//
//   hp::checkpoint::State state;  ...                    // state.h, training_state.h
//   hp::checkpoint::save(state, "ckpt", step);            // ckpt/step-00000100/
//   hp::checkpoint::load(state, "ckpt");                  // the newest complete one
//
// Layout of a checkpoint root:
//   ROOT/step-00000100/metadata.json            the index (written last)
//   ROOT/step-00000100/rank-00000.safetensors   what rank 0 owns, ...
//   ROOT/.tmp-step-00000200/                    a save in progress, or one that crashed
//   ROOT/.hp-save.lock                          who saves into ROOT (root_lock.h)
//
// One job per root: rank 0 of a job holds an flock on ROOT/.hp-save.lock
// from its first save (or claim_root) until it exits, naming itself (host,
// pid, run id) in the file; a second job's save raises CheckpointError
// naming the holder instead of sharing .tmp-step-N and replacing the first
// job's checkpoints (root_lock.h says why a lock and not per-job names).
//
// Crash safety: a save writes into ROOT/.tmp-step-N; each rank fsyncs its
// file; rank 0 writes metadata.json (fsynced) only after every rank's file is
// on disk, then renames the directory to step-N and fsyncs ROOT. The rename
// is the commit: a crash or kill -9 of any rank at any point leaves every
// earlier checkpoint intact and the new one either complete or invisible
// (loads never look at .tmp- directories). Replacing a step swaps the two
// directories atomically where the kernel and file system allow it, else
// renames the old one to .old-step-N first (directory.h's commit_dir).
//
// Leftovers: a save that fails removes its .tmp-step-N; what a crash leaves
// (.tmp-step-N, .old-step-N) is made right by rank 0 when it takes the
// lock: every .tmp-step-N removed, a .old-step-N renamed back to step-N
// when step-N is missing (until then loads read it where it is) and removed
// when step-N exists; each change is said on stderr.
//
// Asynchronous saves (C7): AsyncCheckpointer (async_save.h) snapshots the
// pieces into host memory and writes the same checkpoint on a background
// thread, so training stalls only for the copy.
//
// Both calls are collective over every rank of the job (in one process they
// run alone), in the same order on every rank, with states holding the same
// keys (a key some ranks hold and the others only declare counts as held:
// state.h, hp/pp/pipeline_checkpoint.h). Every failure is agreed: all ranks raise the
// same error (agreement.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/state.h"

namespace hp::checkpoint {

struct SaveOptions {
  // Test hooks (a test kills a rank there to check crash safety), run by
  // the thread that writes (AsyncCheckpointer's background thread):
  // before_rank_file on every rank before it writes its file (what it
  // raises is agreed like a failed write); after_rank_file on every rank
  // once every rank's file is durable; before_commit on rank 0 once
  // metadata.json is durable, before the rename.
  std::function<void()> before_rank_file;
  std::function<void()> after_rank_file;
  std::function<void()> before_commit;
  // AsyncCheckpointer with Staging::kInBackground only: runs on the
  // background thread before it copies the state.
  std::function<void()> before_staging;
};

struct SaveResult {
  std::string path;            // ROOT/step-N
  uint64_t rank_bytes = 0;     // this rank's file
  uint64_t total_bytes = 0;    // every file, metadata included
  double seconds = 0;          // wall time of the whole save on this rank
  // How long the caller was blocked: `seconds` for save(); for
  // AsyncCheckpointer::save the wait for the previous save plus the snapshot.
  double stall_seconds = 0;
};

// Collectively saves `state` as ROOT/step-<step> (replacing a checkpoint of
// the same step). Before any file is written, every rank checks that its
// pieces fit their layouts; a rank's bad piece raises hp::ArgumentError on
// every rank. An I/O failure raises CheckpointError on every rank and leaves
// earlier checkpoints as they were.
SaveResult save(const State& state, const std::string& root, int64_t step,
                const SaveOptions& options = {});

// Collectively makes ROOT this job's before its first save (save() does it
// too): rank 0 takes ROOT's lock and recovers leftovers (above). Raises
// CheckpointError on every rank naming the other holder when another job
// holds ROOT. hp-train calls it at start, so that a second job sharing
// --save-dir stops before it trains, and before it resumes from ROOT, so
// that the resume sees the recovered directories.
void claim_root(const std::string& root);

struct LoadOptions {
  // Checkpoint keys the state does not hold are an error (false: ignored).
  bool strict = true;
  // From a root: only checkpoints of steps up to this one are considered
  // (a caller that checked a step's metadata beforehand loads that one or
  // an older one, never one saved since).
  std::optional<int64_t> newest_step;
};

struct LoadResult {
  std::string path;         // the checkpoint directory read
  int64_t step = 0;         // the step it was saved at
  uint64_t bytes_read = 0;  // by this rank
  double seconds = 0;
  // Newer checkpoints of the root that failed their checks and were
  // skipped, newest first: "DIR: why".
  std::vector<std::string> skipped;
};

// Collectively fills every tensor of `state` in place from `path`: a
// checkpoint directory (one holding metadata.json), or a root, whose newest
// complete checkpoint is taken. Before any tensor changes, every rank
// checks the metadata (its checksum), that the state and the checkpoint hold
// the same keys, with the same global shapes and dtypes, and that the files
// are all there at their recorded sizes; a mismatch raises hp::ArgumentError
// naming the key (missing, unexpected, shape or dtype), a missing or
// truncated file CheckpointError naming it, on every rank. Each chunk read is
// checked against its checksum; a corrupt chunk raises CheckpointError
// naming the file and the key on every rank, after the chunks read before it
// were copied: the state is then partly loaded and must be loaded again.
//
// From a root, a checkpoint that fails those checks with CheckpointError
// (corrupt or missing metadata, files or chunks) is skipped, said on
// stderr (rank 0) and in LoadResult::skipped, and the one before it is
// loaded instead, so that a job restarted after a bad save does not fail
// every restart the same way; when none is left, the only one's own error,
// or a CheckpointError listing every one tried. hp::ArgumentError (another
// state) is raised at once. Each rank resolves the root itself: the ranks
// agree on the step of each checkpoint they try and raise CheckpointError on
// every rank, naming both steps and ranks, when they see different ones.
LoadResult load(State& state, const std::string& path, const LoadOptions& options = {});

// ROOT/step-N of the largest N whose save completed (or ROOT/.old-step-N,
// see Leftovers), or nullopt (none, or no such directory).
std::optional<std::string> latest_checkpoint(const std::string& root);

// "step-00000100": the directory name of step `step`'s checkpoint.
std::string checkpoint_dir_name(int64_t step);

}  // namespace hp::checkpoint
