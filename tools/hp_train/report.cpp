#include "tools/hp_train/report.h"

#include <ATen/ATen.h>

#include <cstdio>

#include "hp/util/format.h"
#include "tools/hp_train/progress.h"

namespace hp::train {

std::string header_text(const TrainOptions& o, const Parallelism& parallelism,
                        const Corpus& corpus, int64_t parameter_count) {
  const int64_t per_rank = o.batch / parallelism.dp_size;
  char lr[32], wd[32], clip[32];
  std::snprintf(lr, sizeof lr, "%g", o.lr);
  std::snprintf(wd, sizeof wd, "%g", o.weight_decay);
  std::snprintf(clip, sizeof clip, "%g", o.grad_clip);
  return cat(
      "hp-train: GPT ", o.layers, " layers, d ", o.d, ", ", o.heads, " heads, ctx ", o.ctx,
      ", vocab ", corpus.vocab_size, ": ", human_count(static_cast<double>(parameter_count)),
      " parameters (", parameter_count, ")",
      o.init_from.empty() ? cat(", seed ", o.seed) : cat(", weights from ", o.init_from), "\n",
      "  mode:   ", parallelism.describe(), "\n",
      parallelism.mode == Mode::kNone
          ? std::string()
          : cat("  fsdp:   comm fusion ", o.comm_fusion ? "on" : "off", ", prefetch ",
                o.prefetch ? "on" : "off", ", reshard after forward ",
                o.reshard_after_forward < 0   ? std::string("true")
                : o.reshard_after_forward == 0 ? std::string("false")
                                               : cat("to groups of ", o.reshard_after_forward),
                ", param dtype ", o.param_dtype, ", reduce dtype ",
                o.reduce_dtype.empty() ? o.param_dtype : o.reduce_dtype, "\n"),
      "  corpus: ", corpus.description, "\n",
      "  batch:  ", o.batch, " x ", o.seq, " tokens per step (", per_rank, " samples per rank), ",
      o.steps, " steps\n",
      "  AdamW:  lr ", lr, " (constant), betas (0.9, 0.95), eps 1e-8, weight decay ", wd,
      ", grad clip ", o.grad_clip > 0 ? clip : "off", "; ", o.threads,
      o.threads == 1 ? " thread" : " threads", " per rank");
}

std::string memory_table(const std::vector<int64_t>& rank_peak_bytes, int64_t parameter_count) {
  std::string text = cat("peak memory per rank (libtorch CPU allocations during training; "
                         "the whole model's fp32 weights are ",
                         human_bytes(parameter_count * 4), "):");
  for (size_t r = 0; r < rank_peak_bytes.size(); ++r) {
    text += cat("\n  rank ", r, ": ", human_bytes(rank_peak_bytes[r]), " (", rank_peak_bytes[r],
                " bytes)");
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
      text += cat(i ? " " : "", data[i]);
    }
  }
  return text;
}

std::string summary_line(double first_loss, double last_loss, int64_t steps, double seconds,
                         double tokens_per_s) {
  char losses[96];
  std::snprintf(losses, sizeof losses, "loss %.4f -> %.4f", first_loss, last_loss);
  return cat(losses, " (first -> last of ", steps, " steps) in ", clock_time(seconds), ", ",
             human_count(tokens_per_s), " tok/s");
}

}  // namespace hp::train
