#include "tools/hp_train/report.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <algorithm>

#include "tools/hp_train/progress.h"

namespace hp::train {

std::string header_text(const TrainOptions& o, const Parallelism& parallelism,
                        const Corpus& corpus, int64_t parameter_count,
                        const std::string& device_line, const std::string& mode_line) {
  const int64_t per_rank = o.batch / parallelism.dp_size();
  std::string text = fmt::format(
      "hp-train: {} {}, d {}, {}, ctx {}, vocab {}: {} parameters ({}), {}\n",
      o.model == "llama" ? "Llama" : "GPT", plural(o.layers, "layer"), o.d,
      o.model == "llama" && o.kv_heads > 0 && o.kv_heads != o.heads
          ? fmt::format("{} ({} key/value)", plural(o.heads, "head"), o.kv_heads)
          : plural(o.heads, "head"),
      o.ctx, corpus.vocab_size,
      human_count(static_cast<double>(parameter_count)), parameter_count,
      o.init_from.empty() ? fmt::format("seed {}", o.seed)
                          : fmt::format("weights from {}", o.init_from));
  text += fmt::format("  mode:   {}\n", mode_line.empty() ? parallelism.describe() : mode_line);
  text += fmt::format("  device: {}\n", device_line);
  if (parallelism.uses_fully_shard() && mode_line.empty()) {
    text += fmt::format(
        "  fsdp:   comm fusion {}, prefetch {}, reshard after forward {}, param dtype {}, "
        "reduce dtype {}\n",
        o.comm_fusion ? "on" : "off (per-parameter collectives)", o.prefetch ? "on" : "off",
        plan::describe(parallelism.reshard_after_forward),
        plan::dtype_name(parallelism.param_dtype),
        plan::dtype_name(parallelism.effective_reduce_dtype()));
  }
  if (o.activation_checkpointing == "blocks") {
    text += "  blocks: activation checkpointing (each recomputed in backward)\n";
  }
  text += fmt::format("  corpus: {}\n", corpus.description);
  text += fmt::format("  batch:  {} x {} tokens per step ({} per rank), {}\n", o.batch, o.seq,
                      plural(per_rank, "sample"), plural(o.steps, "step"));
  text += fmt::format(
      "  AdamW:  lr {:g} (constant), betas (0.9, 0.95), eps 1e-8, weight decay {:g}, grad clip "
      "{}; {} per rank",
      o.lr, o.weight_decay, o.grad_clip > 0 ? fmt::format("{:g}", o.grad_clip) : "off",
      plural(o.threads, "thread"));
  return text;
}

std::string memory_table(const std::vector<int64_t>& rank_peak_bytes, int64_t parameter_count,
                         const std::vector<int64_t>& cuda_peak_allocated,
                         const std::vector<int64_t>& cuda_peak_reserved) {
  const bool gpu = !cuda_peak_allocated.empty();
  std::string text = fmt::format("peak memory per rank (libtorch CPU allocations during training{}; "
                                 "the whole model's fp32 weights are {}):",
                                 gpu ? ", and the GPU's caching allocator" : "",
                                 human_bytes(parameter_count * 4));
  for (size_t r = 0; r < rank_peak_bytes.size(); ++r) {
    text += fmt::format("\n  rank {}: {} ({} bytes)", r, human_bytes(rank_peak_bytes[r]),
                        rank_peak_bytes[r]);
    if (gpu && r < cuda_peak_allocated.size() && r < cuda_peak_reserved.size()) {
      text += fmt::format("; GPU {} allocated, {} reserved", human_bytes(cuda_peak_allocated[r]),
                          human_bytes(cuda_peak_reserved[r]));
    }
  }
  return text;
}

std::string render_tokens(const at::Tensor& ids, int64_t vocab_size) {
  const at::Tensor flat = ids.contiguous().to(at::kLong).view({-1});
  const int64_t* data = flat.data_ptr<int64_t>();
  std::string text;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    if (vocab_size == 256) {
      const auto c = static_cast<unsigned char>(data[i]);
      text += (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f ? '?' : static_cast<char>(c);
    } else {
      text += fmt::format("{}{}", i ? " " : "", data[i]);
    }
  }
  return text;
}

std::string summary_line(double first_loss, double last_loss, int64_t steps, double seconds,
                         double tokens_per_s, double sample_seconds) {
  std::string text = fmt::format("loss {:.4f} -> {:.4f} (first -> last of {}) in {}, {} tok/s",
                                 first_loss, last_loss, plural(steps, "step"),
                                 clock_time(seconds), human_count(tokens_per_s));
  if (sample_seconds > 0) text += fmt::format("; sampling took {:.1f} s", sample_seconds);
  return text;
}

std::string final_line(double first_loss, double last_loss, int64_t first_step, int64_t steps,
                       double seconds, int64_t tokens_per_step, double sample_seconds) {
  const int64_t steps_run = steps - first_step;
  if (steps_run == 0)
    return fmt::format("no step to run: the checkpoint was saved after --steps {}", steps);
  return summary_line(first_loss, last_loss, steps_run, seconds,
                      static_cast<double>(tokens_per_step * steps_run) / std::max(seconds, 1e-9),
                      sample_seconds);
}

}  // namespace hp::train
