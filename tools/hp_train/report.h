// What hp-train prints around the progress lines (rank 0): the header that
// says what is being trained where, and the end-of-run summary.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tools/hp_train/corpus.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// Several lines: model shape and parameter count, mode and mesh, the device
// (`device_line`, e.g. "cuda: NVIDIA H100 80GB HBM3 per rank"), corpus,
// batch split and optimizer settings. `mode_line` replaces the mode line
// the layout describes (a pipeline's).
std::string header_text(const TrainOptions& options, const Parallelism& parallelism,
                        const Corpus& corpus, int64_t parameter_count,
                        const std::string& device_line = "cpu", const std::string& mode_line = "");

// One line per rank: its peak libtorch CPU memory during training, next to
// the unsharded model's fp32 weights for scale.
// On a GPU (`cuda_peak_allocated` and `cuda_peak_reserved` per rank, empty
// on the CPU) each line adds the CUDA caching allocator's peaks.
std::string memory_table(const std::vector<int64_t>& rank_peak_bytes, int64_t parameter_count,
                         const std::vector<int64_t>& cuda_peak_allocated = {},
                         const std::vector<int64_t>& cuda_peak_reserved = {});

// Token ids [N] as text: with a byte vocabulary (256) the bytes themselves,
// control characters other than newline and tab shown as '?'; otherwise the
// ids separated by spaces.
std::string render_tokens(const at::Tensor& ids, int64_t vocab_size);

// "loss 5.5451 -> 2.3012 (first -> last of 300 steps) in 2:31, 2.0k tok/s",
// then "; sampling took 1.2 s" when sample_seconds > 0. `seconds` covers
// the training steps only.
std::string summary_line(double first_loss, double last_loss, int64_t steps, double seconds,
                         double tokens_per_s, double sample_seconds = 0);

// The run's last line: summary_line over the steps run from `first_step` to
// `steps` (`tokens_per_step` each), or, when a resumed checkpoint was saved
// after the last one, that there was no step to run.
std::string final_line(double first_loss, double last_loss, int64_t first_step, int64_t steps,
                       double seconds, int64_t tokens_per_step, double sample_seconds);

}  // namespace hp::train
