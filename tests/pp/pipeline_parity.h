// One training run of the pipeline against one process training the whole
// model on the same micro-batches, shared by the in-process test (ranks as
// threads over LoopbackTransport) and the multi-process one (ranks as
// processes over a process group).
//
// Losses, gradients and the parameters after AdamW steps are compared bit
// for bit: each stage runs the ops the whole model runs on the same values,
// the boundary gradient reaches a stage's output as it reaches the same
// tensor inside the whole model's graph (one sum of the same
// contributions), every parameter's gradient accumulates over the
// micro-batches in micro-batch order in both, and transfers copy bytes.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "hp/mesh/device_mesh.h"
#include "hp/pp/pipeline.h"

namespace hp::pp::parity {

struct Case {
  ScheduleKind kind;
  int ranks;
  int stages_per_rank;
  int microbatches;
  std::vector<std::string> split_points;  // empty: balanced
  bool checkpointing = false;
  bool llama = false;
  int data_parallel = 1;  // replicas of the pipeline, each on its slice of the batch
  // The data-parallel ranks shard each stage (fully_shard over their mesh:
  // every block a unit, then the stage) instead of holding it whole; over
  // a mesh of one rank the units only cast (with compute_dtype).
  bool fully_shard = false;
  // With fully_shard: mixed precision, parameters and compute in this dtype
  // (the stages' units' param_dtype; the loss casts the logits to fp32),
  // gradients reduced in fp32. The reference computes
  // each micro-batch on a copy of its fp32 parameters cast to it, its
  // logits cast to fp32, and adds the micro-batches' gradients in fp32 in
  // order: what the units do, so the comparison stays bitwise.
  std::optional<at::ScalarType> compute_dtype;
  // Tensor parallelism inside every stage (GPT only): the whole model, the
  // reference included, sharded by its tensor-parallel plan over this mesh
  // before the stages are cut from it. The reference is then that TP model
  // in one pipeline stage, and parity stays bitwise: cutting stages changes
  // no op.
  DeviceMeshPtr tp_mesh;
  // Where the model, the reference and the micro-batches live (a GPU: the
  // CUDA suite, tests/cuda/pipeline_test.cpp). The same kernels run on the
  // same values there too, so the comparison stays bitwise.
  c10::Device device{c10::kCPU};
};

std::string name_of(const Case& c);

struct Run {
  std::vector<at::Tensor> losses;              // per step (undefined off the last stage)
  // The reference's: per replica, per step.
  std::vector<std::vector<at::Tensor>> replica_losses;
  std::map<std::string, at::Tensor> grads;     // after the last step's backward
  std::map<std::string, at::Tensor> params;    // after the last step
};

// The whole model in this process. With data_parallel D: each replica's
// gradient (its slice's micro-batches accumulated in order) computed alone,
// then their mean, summed in replica order and divided by D (what an
// all-reduce average does, bit for bit for D = 2: a sum of two terms in
// either order, halved exactly).
Run reference_run(const Case& c);

// Pipeline rank `rank`'s stages of the case's model, built from the same
// seed as the reference (call one rank after the other within a process:
// the weights come from the one default generator).
std::vector<StageModule> build_stages(const Case& c, int rank);

// Trains `stages` as pipeline rank transport->rank() of replica `replica`
// (its slice of each batch; gradients averaged over `replicas`, the
// data-parallel group, when the case has several) for the case's steps.
// A fully_shard case shards the stages over `fsdp_mesh` (the data-parallel
// mesh, whose rank `replica` is) instead; the run then holds the local
// shards.
Run pipeline_run(const Case& c, std::vector<StageModule> stages,
                 std::shared_ptr<Transport> transport, int replica = 0,
                 dist::GroupPtr replicas = nullptr, DeviceMeshPtr fsdp_mesh = nullptr);

// Expects `rank`'s run to equal the reference's for what the rank holds
// (a fully_shard case: replica `replica`'s dim-0 shard of each tensor, as
// fully_shard cuts it); returns how many parameters it compared.
size_t expect_rank_matches(const Case& c, int rank, const Run& got, const Run& reference,
                           int replica = 0);

}  // namespace hp::pp::parity
