#include "hp/plan/parameter_table.h"

#include <functional>
#include <numeric>
#include <unordered_set>

#include <fmt/format.h>

namespace hp::plan::detail {

namespace {

// The units of a model whose blocks' parameters start with
// Config::block_prefix(i); `unit_name` names block i "<unit_name>.<i>".
template <typename Config>
ModelParameters split_by_unit(const Config& config, const char* unit_name) {
  ModelParameters out;
  std::vector<std::string> prefixes;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    prefixes.push_back(Config::block_prefix(i));
    out.block_names.push_back(fmt::format("{}.{}", unit_name, i));
  }
  out.blocks.resize(prefixes.size());
  for (const nn::ParameterShape& p : config.parameter_shapes()) {
    const int64_t rest = std::accumulate(p.shape.begin() + 1, p.shape.end(), int64_t{1},
                                         std::multiplies<int64_t>());
    size_t unit = 0;
    std::string name = p.name;
    for (size_t i = 0; i < prefixes.size() && unit == 0; ++i) {
      if (name.rfind(prefixes[i], 0) == 0) {
        unit = i + 1;
        name = name.substr(prefixes[i].size());
      }
    }
    std::vector<ParamShape>& params = unit == 0 ? out.root : out.blocks[unit - 1];
    out.order.emplace_back(unit, params.size());
    params.push_back({name, p.shape.at(0), rest});
  }
  return out;
}

}  // namespace

int64_t tp_piece(int64_t n, int64_t tp, int64_t tp_rank) {
  const int64_t c = (n + tp - 1) / tp;
  return std::min(c, std::max<int64_t>(0, n - tp_rank * c));
}

ModelParameters model_parameters(const std::variant<nn::GPTConfig, nn::LlamaConfig>& model) {
  if (const auto* gpt = std::get_if<nn::GPTConfig>(&model)) return split_by_unit(*gpt, "h");
  return split_by_unit(std::get<nn::LlamaConfig>(model), "layers");
}

void apply_tensor_parallel_plan(ModelParameters& parameters, int64_t tp, int64_t tp_rank) {
  // Split by rows: the embedding and the head by vocabulary rows, the
  // column-parallel projections (QKV, c_fc; q/k/v, gate, up) by output
  // rows. Split by columns: the row-parallel projections (both c_proj;
  // o_proj, down_proj) by input columns. The rest (norms) is replicated.
  // Heads and the MLP's width divide evenly (make_step_setup checks).
  static const std::unordered_set<std::string> by_rows = {
      "wte.weight", "lm_head.weight", "attn.c_attn.weight", "attn.c_attn.bias",
      "mlp.c_fc.weight", "mlp.c_fc.bias", "model.embed_tokens.weight",
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "mlp.gate_proj.weight", "mlp.up_proj.weight"};
  static const std::unordered_set<std::string> by_columns = {
      "attn.c_proj.weight", "mlp.c_proj.weight", "self_attn.o_proj.weight",
      "mlp.down_proj.weight"};
  auto split = [&](ParamShape& p) {
    if (by_rows.count(p.name)) p.dim0 = tp_piece(p.dim0, tp, tp_rank);
    if (by_columns.count(p.name)) p.rest = tp_piece(p.rest, tp, tp_rank);
  };
  for (ParamShape& p : parameters.root) split(p);
  for (auto& block : parameters.blocks) {
    for (ParamShape& p : block) split(p);
  }
}

}  // namespace hp::plan::detail
