#include "bench/rows.h"

#include <string>
#include <utility>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::bench {

namespace {

int one(const BenchConfig&) { return 1; }
int data_parallel(const BenchConfig& c) { return c.ranks; }
int hsdp(const BenchConfig& c) { return c.hsdp_ranks; }
int dp_tp_2x2(const BenchConfig&) { return 4; }  // a (dp, tp) mesh of 2 x 2
int pipeline_ranks(const BenchConfig&) { return 4; }  // pp 4, or (dp, pp) = (2, 2)

std::string hsdp_note(const BenchConfig& c) {
  if (c.hsdp_ranks == 2) {
    return "degenerate HSDP: 2 ranks give the mesh [1, 2] (replicate 1 x shard 2), so the "
           "replicate all-reduce has a group of one and moves nothing; the row measures the "
           "2-D HSDP code path at the same per-rank work as fsdp_fused_prefetch, not "
           "cross-replica traffic. Run with --hsdp-ranks 4 for a real [2, 2] mesh.";
  }
  return "HSDP on [" + std::to_string(c.hsdp_ranks / 2) + ", 2] with " +
         std::to_string(c.hsdp_ranks) +
         " ranks: more processes than this machine may have cores, so its step time is "
         "oversubscribed and does not compare with the 2-rank rows; tokens_per_s counts all " +
         std::to_string(c.hsdp_ranks) + " ranks' tokens.";
}

std::string fsdp_tp_note(const BenchConfig&) {
  return "tensor parallel in pairs of ranks, fully_shard over the 2 pairs ((dp, tp) = (2, 2)): 4 "
         "processes, more than a 2-core machine has, so compare its tokens_per_s (both pairs' "
         "samples) rather than its step time with the 2-rank rows";
}

std::string pipeline_note(const BenchConfig& c) {
  return "pipeline over 4 ranks, a GPT of " + std::to_string(c.pp_layers) +
         " blocks (--pp-layers; the other rows have --layers), all ranks sharing one batch of " +
         std::to_string(c.batch) + " samples in " + std::to_string(c.pp_microbatches) +
         " micro-batches: 4 processes, more than a 2-core machine has, so compare it with its "
         "torch_ twin rather than with the 2-rank rows. pp 4 alone: no data parallelism (dp2_pp2 "
         "adds it).";
}

std::string dp_pp_note(const BenchConfig& c) {
  return "(dp, pp) = (2, 2) over 4 ranks: each stage fully_shard'ed over its 2 dp ranks, 1F1B "
         "over the 2 pp ranks, a GPT of " + std::to_string(c.pp_layers) +
         " blocks (--pp-layers) in 2 stages; each replica trains on half of the batch of " +
         std::to_string(c.batch) + " samples in " + std::to_string(c.pp_microbatches / 2) +
         " micro-batches (the pp4 rows' micro-batch size): 4 processes, more than a 2-core "
         "machine has, so compare it with its torch_ twin rather than with the 2-rank rows.";
}

constexpr auto kWorker = RowLauncher::kWorker;
constexpr auto kPython = RowLauncher::kPython;
constexpr auto kPerRank = RowBatch::kPerRank;

// The extras (standard = false) are for investigation: ddp_unfused = ddp
// without comm_fusion (one all-reduce per parameter, where ddp buckets them
// per unit as DDP does), fsdp_prefetch = fsdp with prefetch on (separates
// prefetch from fusion), checkpoint = save and load GB/s of a ~100M-parameter
// model beside a plain write and read of the same bytes
// (bench/checkpoint_worker.cpp). fsdp_ac is fsdp with every block's
// activations checkpointed (N4).
const std::vector<Row> kRows = {
    // name, standard, launcher, script, ranks, batch, communicates, note, timeout x
    {"single", true, kWorker, nullptr, one, kPerRank, false, nullptr, 1},
    {"ddp", true, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"fsdp", true, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"fsdp_ac", true, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"fsdp_fused", true, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"fsdp_fused_prefetch", true, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"hsdp_fused_prefetch", true, kWorker, nullptr, hsdp, kPerRank, true, hsdp_note, 1},
    {"tp", true, kWorker, nullptr, data_parallel, RowBatch::kShared, true, nullptr, 1},
    {"fsdp_tp", true, kWorker, nullptr, dp_tp_2x2, RowBatch::kPerPair, true, fsdp_tp_note, 1},
    {"torch_single", true, kPython, "torch_single_baseline.py", one, kPerRank, false, nullptr, 1},
    {"torch_ddp", true, kPython, "torch_ddp_baseline.py", data_parallel, kPerRank, true, nullptr,
     1},
    {"torch_fsdp2", true, kPython, "torch_fsdp2_baseline.py", data_parallel, kPerRank, true,
     nullptr, 1},
    {"ddp_unfused", false, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    {"fsdp_prefetch", false, kWorker, nullptr, data_parallel, kPerRank, true, nullptr, 1},
    // Pipeline parallelism (docs/benchmarks.md): ours and PyTorch's
    // torch.distributed.pipelining on the same stages and micro-batches.
    {"pp4", false, kWorker, nullptr, pipeline_ranks, RowBatch::kShared, true, pipeline_note, 1},
    {"pp4_gpipe", false, kWorker, nullptr, pipeline_ranks, RowBatch::kShared, true,
     pipeline_note, 1},
    {"pp4_interleaved", false, kWorker, nullptr, pipeline_ranks, RowBatch::kShared, true,
     pipeline_note, 1},
    {"pp4_zero_bubble", false, kWorker, nullptr, pipeline_ranks, RowBatch::kShared, true,
     pipeline_note, 1},
    {"torch_pp4", false, kPython, "torch_pipeline_baseline.py", pipeline_ranks,
     RowBatch::kShared, true, pipeline_note, 1},
    {"torch_pp4_gpipe", false, kPython, "torch_pipeline_baseline.py", pipeline_ranks,
     RowBatch::kShared, true, pipeline_note, 1},
    {"torch_pp4_interleaved", false, kPython, "torch_pipeline_baseline.py", pipeline_ranks,
     RowBatch::kShared, true, pipeline_note, 1},
    {"torch_pp4_zero_bubble", false, kPython, "torch_pipeline_baseline.py", pipeline_ranks,
     RowBatch::kShared, true, pipeline_note, 1},
    // Data parallelism x pipeline: ours (fully_shard inside the stages) and
    // PyTorch's FSDP2 + torch.distributed.pipelining, as torchtitan composes them.
    {"dp2_pp2", false, kWorker, nullptr, pipeline_ranks, RowBatch::kShared, true, dp_pp_note, 1},
    {"torch_dp2_pp2", false, kPython, "torch_pipeline_baseline.py", pipeline_ranks,
     RowBatch::kShared, true, dp_pp_note, 1},
    // Saves and loads ckpt_repeats times, each with its plain write and read:
    // longer than a step-time row.
    {"checkpoint", false, RowLauncher::kCheckpoint, nullptr, data_parallel, kPerRank, true,
     nullptr, 3},
};

std::vector<std::string> names_where(bool standard) {
  std::vector<std::string> names;
  for (const Row& r : kRows) {
    if (r.standard == standard) names.emplace_back(r.name);
  }
  return names;
}

}  // namespace

int64_t Row::samples_per_step(const BenchConfig& c) const {
  switch (batch) {
    case RowBatch::kShared: return c.batch;
    case RowBatch::kPerPair: return ranks(c) / 2 * c.batch;
    case RowBatch::kPerRank: break;
  }
  return ranks(c) * c.batch;
}

const std::vector<Row>& all_rows() { return kRows; }

const PipelineRow* pipeline_row(const Row& row) {
  // By the name without "torch_": a twin runs its row's schedule.
  static const std::vector<std::pair<std::string, PipelineRow>> kSchedules = {
      {"pp4", {"1f1b", 1, 1}},
      {"pp4_gpipe", {"gpipe", 1, 1}},
      {"pp4_interleaved", {"interleaved", 2, 1}},
      {"pp4_zero_bubble", {"zero-bubble", 2, 1}},
      {"dp2_pp2", {"1f1b", 1, 2}}};
  std::string name = row.name;
  if (name.rfind("torch_", 0) == 0) name = name.substr(6);
  for (const auto& [pp_name, schedule] : kSchedules)
    if (name == pp_name) return &schedule;
  return nullptr;
}

const std::vector<std::string>& row_names() {
  static const std::vector<std::string> names = names_where(true);
  return names;
}

const std::vector<std::string>& extra_row_names() {
  static const std::vector<std::string> names = names_where(false);
  return names;
}

const Row& find_row_spec(const std::string& name) {
  for (const Row& r : kRows) {
    if (name == r.name) return r;
  }
  throw ArgumentError(cat("--rows: unknown row '", name, "', expected some of ",
                          to_string(row_names()), " or ", to_string(extra_row_names())));
}

}  // namespace hp::bench
