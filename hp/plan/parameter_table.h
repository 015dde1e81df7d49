// The model's parameters as the memory plan (P2) simulates them: read from
// the config's parameter_shapes() (hp/nn/gpt_config.h, llama_config.h), so
// the plan cannot drift from the model, grouped by hp-train's fully_shard
// units, and split by the model's tensor-parallel plan. Internal to hp/plan.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "hp/nn/gpt_config.h"
#include "hp/nn/llama_config.h"

namespace hp::plan::detail {

// One parameter: its full shape as [dim0, rest...] and, after sharding over
// `shards` ranks along dim 0, what this rank holds (docs/design.md, "The
// life of a parameter"): a zero-padded chunk of ceil(dim0 / shards) rows,
// of which the torch.chunk piece is the parameter (what AdamW's moments
// are shaped like), and an unsharded buffer of shards * chunk rows.
struct ParamShape {
  std::string name;
  int64_t dim0 = 0;
  int64_t rest = 1;  // product of the other dims

  int64_t numel() const { return dim0 * rest; }
  int64_t chunk(int64_t shards) const { return (dim0 + shards - 1) / shards; }
  int64_t padded(int64_t shards) const { return chunk(shards) * rest; }
  int64_t unsharded(int64_t shards) const { return shards * padded(shards); }
  int64_t local(int64_t shards, int64_t shard_rank) const {
    const int64_t c = chunk(shards);
    return std::min(c, std::max<int64_t>(0, dim0 - shard_rank * c)) * rest;
  }
};

// torch.chunk's piece of `n` rows or columns on tensor-parallel rank
// `tp_rank` of `tp`.
int64_t tp_piece(int64_t n, int64_t tp, int64_t tp_rank);

// hp-train's units: the root (what no block holds, named as the model names
// it), then each block (named within the block), in named_parameters()
// order within each.
struct ModelParameters {
  std::vector<ParamShape> root;
  std::vector<std::vector<ParamShape>> blocks;
  std::vector<std::string> block_names;  // "h.0" (GPT), "layers.0" (Llama)
  // named_parameters() order as (unit, index): unit 0 the root, i + 1 block i.
  std::vector<std::pair<size_t, size_t>> order;
};

ModelParameters model_parameters(const std::variant<nn::GPTConfig, nn::LlamaConfig>& model);

// Each parameter becomes its local tensor on tensor-parallel rank `tp_rank`
// of `tp` under the model's plan (hp/tp/gpt_plan.h, hp/tp/llama_plan.h).
void apply_tensor_parallel_plan(ModelParameters& parameters, int64_t tp, int64_t tp_rank);

}  // namespace hp::plan::detail
