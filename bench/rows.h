// hp-bench's rows (A2): the one table of what each row is, which the driver
// reads instead of comparing names. How our GPT rows configure fully_shard
// (mesh, fusion, prefetch) is the worker's (bench_worker.cpp).
// The table is immutable static data; functions here may be called from any
// thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench_config.h"

namespace hp::bench {

// How the driver starts a row.
enum class RowLauncher {
  kWorker,      // our GPT worker: hprun -n R hp-bench --worker NAME, once per round
  kPython,      // a PyTorch baseline: hprun -n R PYTHON SCRIPT, once per round
  kCheckpoint,  // the checkpoint worker: no step-time row, run once after the rounds
};

// Which samples one step of a row trains on, from its ranks.
enum class RowBatch {
  kPerRank,  // data parallel: a batch per rank
  kShared,   // tensor and pipeline parallel: all ranks share one batch (dp2_pp2: its
             // replicas split it)
  kPerPair,  // (dp, tp) = (ranks / 2, 2): a batch per pair of ranks
};

struct Row {
  const char* name;
  bool standard;           // in the default set, run when --rows is not given
  RowLauncher launcher;
  const char* script;      // kPython: the baseline's file, beside --torch-script
  int (*ranks)(const BenchConfig&);
  RowBatch batch;
  bool communicates;       // false: no exposed_comm_fraction (one process)
  std::string (*note)(const BenchConfig&);  // what the figures mean; nullptr: none
  int timeout_multiple;    // of --row-timeout

  // A PyTorch row: its peak memory is an RSS delta, its collectives its own count.
  bool torch() const { return launcher == RowLauncher::kPython; }
  // Samples one step trains on (tokens_per_s counts them).
  int64_t samples_per_step(const BenchConfig& c) const;
};

// The schedule a pipeline row runs (ours and its torch_ twin alike), over
// ranks(c) / data_parallel pipeline ranks holding stages_per_rank stages
// each. With data_parallel D > 1 the ranks are a (dp, pp) mesh of
// (D, ranks / D), row-major; each stage is fully_shard'ed over dp
// (docs/pipeline.md "fully_shard and tensor parallelism inside stages") and
// replica r trains on its 1/D of the batch in microbatches(c) micro-batches.
struct PipelineRow {
  const char* schedule;  // hp::pp::parse_schedule_kind's name: gpipe, 1f1b, interleaved, zero-bubble
  int stages_per_rank;
  int data_parallel;     // 1: pp alone

  int pipeline_ranks(int ranks) const { return ranks / data_parallel; }
  // Per replica: pp_microbatches / D, so that a micro-batch holds as many
  // samples (batch / pp_microbatches) as in the pp-only rows.
  int64_t microbatches(const BenchConfig& c) const { return c.pp_microbatches / data_parallel; }
};

// The schedule of `row` if it is a pipeline row, else nullptr.
const PipelineRow* pipeline_row(const Row& row);

// Every row, in the order of the table: the standard rows, then the extras.
const std::vector<Row>& all_rows();

// The row called `name`; hp::ArgumentError naming it and the known rows otherwise.
const Row& find_row_spec(const std::string& name);

}  // namespace hp::bench
