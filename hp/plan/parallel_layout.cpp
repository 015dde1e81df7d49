#include "hp/plan/parallel_layout.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::plan {

namespace {

// The one table of modes: name and mesh dim names, in --mode's help order.
struct ModeRow {
  ParallelMode mode;
  const char* name;
  std::vector<std::string> dims;
};

const std::vector<ModeRow>& mode_table() {
  static const std::vector<ModeRow> table = {
      {ParallelMode::kFSDP, "fsdp", {"shard"}},
      {ParallelMode::kHSDP, "hsdp", {"replicate", "shard"}},
      // fully_shard's DDP: a replicate dim over every rank, a shard dim of one.
      {ParallelMode::kDDP, "ddp", {"replicate", "shard"}},
      {ParallelMode::kTP, "tp", {"tp"}},
      {ParallelMode::kFSDPTP, "fsdp_tp", {"dp", "tp"}},
      {ParallelMode::kNone, "none", {}},
  };
  return table;
}

const ModeRow& row_of(ParallelMode mode) {
  const auto& table = mode_table();
  return *std::find_if(table.begin(), table.end(),
                       [&](const ModeRow& row) { return row.mode == mode; });
}

std::string plural(int64_t count, const char* noun) {
  return fmt::format("{} {}{}", count, noun, count == 1 ? "" : "s");
}

}  // namespace

const char* mode_name(ParallelMode mode) { return row_of(mode).name; }

std::vector<std::string> mode_names() {
  std::vector<std::string> names;
  for (const ModeRow& row : mode_table()) names.emplace_back(row.name);
  return names;
}

ParallelMode parse_mode(const std::string& name, const std::string& what) {
  for (const ModeRow& row : mode_table()) {
    if (name == row.name) return row.mode;
  }
  throw ArgumentError(cat(what, " must be one of ",
                          fmt::format("{}", fmt::join(mode_names(), ", ")), ", got '", name, "'"));
}

int64_t element_size(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return "fp32";
    case Dtype::kBFloat16: return "bf16";
    case Dtype::kFloat16: return "fp16";
  }
  return "?";
}

Dtype parse_dtype(const std::string& name, const std::string& what) {
  for (Dtype dtype : {Dtype::kBFloat16, Dtype::kFloat16, Dtype::kFloat32}) {
    if (name == dtype_name(dtype)) return dtype;
  }
  throw ArgumentError(cat(what, " must be one of bf16, fp16, fp32, got '", name, "'"));
}

c10::ScalarType scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return c10::kFloat;
    case Dtype::kBFloat16: return c10::kBFloat16;
    case Dtype::kFloat16: return c10::kHalf;
  }
  return c10::kFloat;
}

ReshardAfterForward parse_reshard_after_forward(const std::string& text,
                                                const std::string& what) {
  if (text == "true") return true;
  if (text == "false") return false;
  int64_t ranks = 0;
  size_t used = 0;
  try {
    ranks = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  HP_CHECK_ARG(used > 0 && used == text.size() && ranks >= 1, what, " must be true, false or a "
               "positive number of ranks, got '", text, "'");
  return ranks;
}

std::string describe(const ReshardAfterForward& setting) {
  if (!setting) return "true";
  if (const bool* reshard = std::get_if<bool>(&*setting)) return *reshard ? "true" : "false";
  return fmt::format("to groups of {}", std::get<int64_t>(*setting));
}

ParallelLayout::ParallelLayout(ParallelMode mode, std::vector<int64_t> mesh_shape)
    : mode(mode), mesh_shape(std::move(mesh_shape)), mesh_names(row_of(mode).dims) {
  const char* name = mode_name(mode);
  HP_CHECK_ARG(this->mesh_shape.size() == mesh_names.size(), "ParallelLayout: mode ", name,
               " takes a ", mesh_names.size(), "-D mesh but got ", to_string(this->mesh_shape));
  for (int64_t size : this->mesh_shape) {
    HP_CHECK_ARG(size >= 1, "ParallelLayout: mesh ", to_string(this->mesh_shape),
                 " has a size below 1");
  }
  HP_CHECK_ARG(mode != ParallelMode::kDDP || this->mesh_shape[1] == 1, "ParallelLayout: mode ddp "
               "takes a mesh [N, 1] (replicate, shard) but got ", to_string(this->mesh_shape));
}

int64_t ParallelLayout::dim_size(const char* name) const {
  for (size_t i = 0; i < mesh_names.size(); ++i) {
    if (mesh_names[i] == name) return mesh_shape.at(i);
  }
  return 1;
}

int64_t ParallelLayout::tp_size() const { return dim_size("tp"); }

// fully_shard shards over the "shard" dim, or fsdp_tp's "dp" dim.
int64_t ParallelLayout::shard_size() const { return dim_size("shard") * dim_size("dp"); }

int64_t ParallelLayout::replicate_size() const { return dim_size("replicate"); }

int64_t ParallelLayout::world_size() const {
  return std::accumulate(mesh_shape.begin(), mesh_shape.end(), int64_t{1},
                         std::multiplies<int64_t>());
}

bool ParallelLayout::tensor_parallel() const {
  return std::find(mesh_names.begin(), mesh_names.end(), "tp") != mesh_names.end();
}

ReshardAfterForward ParallelLayout::block_reshard_after_forward(int64_t block,
                                                                int64_t blocks) const {
  HP_CHECK_ARG(block >= 0 && block < blocks, "ParallelLayout::block_reshard_after_forward: "
               "block ", block, " is not one of ", blocks, " blocks");
  if (block + 1 == blocks) return false;
  return reshard_after_forward;
}

bool ParallelLayout::uses_fully_shard() const {
  return mode != ParallelMode::kNone && (mode != ParallelMode::kTP || tp_units);
}

std::string ParallelLayout::describe() const {
  if (mode == ParallelMode::kNone) return "none (one process, no process group)";
  std::string text = fmt::format("{} on mesh {} {}", mode_name(mode), to_string(mesh_shape),
                                 to_string(mesh_names));
  switch (mode) {
    case ParallelMode::kFSDP:
      text += fmt::format(": parameters sharded over {}", plural(shard_size(), "rank"));
      break;
    case ParallelMode::kHSDP:
      text += fmt::format(": {}, each sharded over {}", plural(replicate_size(), "replica"),
                          plural(shard_size(), "rank"));
      break;
    case ParallelMode::kDDP:
      text += fmt::format(": parameters replicated on {}", plural(replicate_size(), "rank"));
      break;
    case ParallelMode::kTP:
      text += fmt::format(": every layer split over {}", plural(tp_size(), "rank"));
      break;
    case ParallelMode::kFSDPTP:
      text += fmt::format(": every layer split over {}, its pieces sharded over {}",
                          plural(tp_size(), "rank"), plural(shard_size(), "data-parallel rank"));
      break;
    case ParallelMode::kNone:
      break;
  }
  return text + fmt::format(", data-parallel size {}", dp_size());
}

}  // namespace hp::plan
