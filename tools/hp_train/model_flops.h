// Model FLOPs utilisation (MFU): the FLOPs a training step of the model
// needs, per second, against the card's dense bf16 peak.
//
// The count is the usual one (PaLM, appendix B; torchtitan): per token,
//   6 * (N - E) + 12 * L * d * T
// N the parameters, E those of the embedding tables (a lookup, not a
// matmul), L the blocks, d the width, T the tokens a sample attends over
// (--seq). 6 = 2 FLOPs per multiply-add x (forward + two in backward) for
// every matmul weight; 12 * L * d * T = the attention scores and their use,
// forward and backward, counted in full (not halved for the causal mask).
// Recomputation (activation checkpointing) is not counted: MFU measures the
// model's work, not the hardware's. docs/gpu.md has the derivation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hp::train {

struct FlopsShape {
  int64_t parameters = 0;            // N: every parameter of the model
  int64_t embedding_parameters = 0;  // E: token (and position) tables
  int64_t layers = 0;                // L
  int64_t width = 0;                 // d
  int64_t seq = 0;                   // T
};

// 6 (N - E) + 12 L d T, in double (exact for any model that fits a GPU).
double training_flops_per_token(const FlopsShape& shape);

// The dense bf16 tensor-core peak, in FLOP/s, of a card known by the name
// CUDA gives it ("NVIDIA H100 80GB HBM3": 989.4e12); nullopt for a card not
// in the table (the caller then asks for --peak-tflops).
std::optional<double> bf16_peak_flops(const std::string& card_name);

}  // namespace hp::train
