// The lock that makes a checkpoint root one job's (C4 in docs/features.md).
//
// Two jobs saving into one root would share ROOT/.tmp-step-N and replace
// each other's step-N: a job's rank 0 therefore holds an flock(2) on
// ROOT/.hp-save.lock from its first save (or claim_root, checkpoint.h) of
// that root until the process exits, and writes into the file who holds it
// ("host H pid P run R since T"). A second job's save finds the lock taken
// and raises CheckpointError naming the root and that holder. The kernel
// drops the lock with the process, however it ends (kill -9 included), so a
// restarted job takes it again; the file stays (removing a lock file races
// with a job opening it) and its text is only informative.
//
// Why a lock and not per-job temporary names plus a run id: separate
// temporary directories would stop two jobs from mixing files mid-save,
// but their commits would still replace each other's step-N and "the
// newest checkpoint" would interleave two runs; refusing the second job at
// its first save (hp-train: at start), naming the first, is what lets the
// user fix the mistake. Holding the lock for the whole job also makes
// sweeping leftovers safe: no other job can be writing there.
//
// On NFS, Linux maps flock onto the server's byte-range locks (NFSv4, or
// NLM for v3), so jobs on different hosts exclude each other too; a file
// system without locks makes every save fail, naming it, rather than run
// unprotected.
//
// Not collective: rank 0 calls it inside an agreed step (agreement.h).
#pragma once

#include <mutex>
#include <string>

namespace hp::checkpoint {

// The name of the lock file inside a root.
inline constexpr const char* kRootLockFile = ".hp-save.lock";

// Makes this process the holder of ROOT's lock, creating ROOT when missing.
// Returns true when this call took it (the process's first save into ROOT,
// or ROOT's lock file was replaced since), false when the process held it
// already. Raises CheckpointError naming ROOT and the other holder when
// another process holds it, or the file and the error when it cannot be
// opened or locked (a link, a directory, a file system without locks).
bool lock_root(const std::string& root);

// This process's holder text: "host H pid P run R since T". R is a random
// run id drawn once per process, so a lock file left by an earlier run of
// the same pid is told apart.
const std::string& lock_holder_text();

// Serialises this process's changes to the directories of its roots
// (prepare, commit, recovery), which concurrent savers in one process
// (AsyncCheckpointer threads) would otherwise interleave.
std::mutex& root_directory_mutex();

}  // namespace hp::checkpoint
