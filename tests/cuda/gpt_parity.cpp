#include "tests/cuda/gpt_parity.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "hp/distributed/world.h"
#include "hp/fsdp/state_dict.h"
#include "hp/nn/loss.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"

namespace hp::cuda_test {

nn::GPT make_gpt(c10::Device device, uint64_t seed) {
  torch::manual_seed(seed);
  nn::GPT model(test::gpt_config(
      {/*vocab=*/64, /*context=*/16, /*layers=*/2, /*heads=*/2, /*width=*/32}));
  model->to(device);
  return model;
}

FSDPModule shard_gpt(nn::GPT& model, const FullyShardOptions& options) {
  FullyShardOptions block_options = options;
  block_options.mp_policy.output_dtype.reset();
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), block_options);
  return fully_shard(model.ptr(), options);
}

namespace {

// Rows of one global micro-batch: 8 / world rows a rank.
constexpr int64_t kRows = 8;

// The AdamW of tests/fsdp/gpt_fixture.h.
const test::AdamWHyper kAdam{1e-2, 0.9, 0.95, 1e-8, 0.1};

torch::optim::AdamW make_adamw(const std::vector<at::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(kAdam.lr)
                                         .betas({kAdam.beta1, kAdam.beta2})
                                         .eps(kAdam.eps)
                                         .weight_decay(kAdam.weight_decay));
}

at::Tensor step_tokens(int64_t step, int64_t rows, c10::Device device) {
  return at::randint(64, {rows, 17}, at::detail::createCPUGenerator(300 + step), at::kLong)
      .to(device);
}

// Mean cross-entropy of rows [first, first + rows), on fp32 logits.
at::Tensor loss_on_rows(nn::GPT& model, const at::Tensor& tokens, int64_t first, int64_t rows) {
  at::Tensor batch = tokens.narrow(0, first, rows);
  const int64_t t = tokens.size(1) - 1;
  return nn::cross_entropy(model(batch.narrow(1, 0, t)).to(at::kFloat), batch.narrow(1, 1, t));
}

// The reference's step: every part (a rank's micro-batch) in turn on fresh
// gradients, in the compute dtype when one is given.
struct ReferenceStep {
  std::vector<double> losses;    // per part
  std::vector<at::Tensor> grad;  // fp32, on the device: micro_batches * Σ parts / parts
  std::vector<at::Tensor> bound;  // Double, host: reordered_sum_bound of the parts' terms
};

ReferenceStep reference_step(nn::GPT& reference, const at::Tensor& tokens, int64_t parts,
                             int64_t micro_batches, std::optional<at::ScalarType> dtype,
                             c10::Device device) {
  std::vector<at::Tensor> params = reference->parameters();
  nn::GPT compute = reference;
  if (dtype) {
    compute = nn::GPT(reference->config());
    compute->to(device);
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> copies = compute->parameters();
    for (size_t i = 0; i < params.size(); ++i) copies[i].set_data(params[i].detach().to(*dtype));
  }
  std::vector<at::Tensor> computing = compute->parameters();
  const int64_t rows = kRows / (parts / micro_batches);
  ReferenceStep out;
  std::vector<at::Tensor> sum(params.size()), sum_abs(params.size());
  for (int64_t p = 0; p < parts; ++p) {
    for (auto& t : computing) t.mutable_grad() = at::Tensor();
    at::Tensor loss = loss_on_rows(compute, tokens, p * rows, rows);
    loss.backward();
    out.losses.push_back(loss.item<double>());
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = computing[i].grad().to(at::kFloat);
      sum[i] = p == 0 ? g.clone() : sum[i] + g;
      at::Tensor a = g.abs().to(at::kDouble).cpu() / double(parts);
      sum_abs[i] = p == 0 ? a : sum_abs[i] + a;
    }
  }
  // The sharded run adds its micro-batches' gradients and averages over
  // the ranks: micro_batches times the mean over the parts. Both factors
  // are powers of two (parts = ranks * micro_batches with 1, 2 or 4 ranks
  // and 1 or 2 micro-batches), so the scalings round nothing.
  const double scale = double(micro_batches) / double(parts);
  for (size_t i = 0; i < params.size(); ++i) {
    out.grad.push_back(sum[i] * scale);
    out.bound.push_back(
        test::reordered_sum_bound(sum_abs[i] * double(micro_batches), parts, at::kFloat));
    params[i].mutable_grad() = out.grad.back();
  }
  return out;
}

}  // namespace

void expect_training_matches(const TrainingCase& c) {
  const DeviceMeshPtr& mesh = c.options.mesh;
  const c10::Device device = mesh->device();
  const int64_t w = dist::get_world_size(), r = dist::get_rank();
  const int64_t rows = kRows / w, m_count = c.micro_batches, parts = w * m_count;
  // The shard dim is the mesh's last (FSDP's only dim, HSDP's "shard").
  const int64_t last = static_cast<int64_t>(mesh->coordinate().size()) - 1;
  const int64_t shard_size = mesh->size(last), shard_rank = mesh->coordinate(last);

  nn::GPT reference = make_gpt(device);
  std::vector<at::Tensor> ref_params = reference->parameters();
  auto ref_opt = make_adamw(ref_params);
  nn::GPT model = make_gpt(device);
  FSDPModule root = shard_gpt(model, c.options);
  if (c.configure) c.configure(root);
  auto opt = make_adamw(model->parameters());
  test::AdamWBound adam(kAdam);

  // This rank's piece of a whole host tensor shaped as parameter i.
  auto piece = [&](const at::Tensor& whole, size_t i) {
    const int64_t dim = c.shard_dim ? c.shard_dim(ref_params[i]) : 0;
    return whole.chunk(shard_size, dim)[shard_rank];
  };

  for (int64_t step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor tokens = step_tokens(step, kRows * m_count, device);
    ReferenceStep ref = reference_step(reference, tokens, parts, m_count, c.compute_dtype, device);

    for (int64_t m = 0; m < m_count; ++m) {
      root.set_requires_gradient_sync(m == m_count - 1);
      const int64_t part = m * w + r;
      at::Tensor loss = loss_on_rows(model, tokens, part * rows, rows);
      // The same rows through the same kernels on the same parameters.
      EXPECT_EQ(loss.item<double>(), ref.losses[part]) << "micro-batch " << m;
      loss.backward();
    }

    size_t i = 0;
    for (const auto& item : model->named_parameters()) {
      SCOPED_TRACE(item.key());
      ASSERT_LT(i, ref_params.size());
      const at::Tensor& grad = item.value().grad();
      ASSERT_TRUE(grad.defined());
      EXPECT_EQ(grad.scalar_type(), at::kFloat);
      EXPECT_TRUE(test::within_bound(grad.cpu(), piece(ref.grad[i].cpu(), i), piece(ref.bound[i], i)))
          << "gradient";
      ++i;
    }
    EXPECT_EQ(i, ref_params.size());

    std::vector<at::Tensor> param_bounds;
    auto names = reference->named_parameters();
    for (size_t j = 0; j < ref_params.size(); ++j) {
      param_bounds.push_back(adam.step(names[j].key(), ref_params[j].detach().cpu(),
                                       ref.grad[j].cpu(), ref.bound[j]));
    }
    ref_opt.step();
    opt.step();
    for (auto& p : ref_params) p.mutable_grad() = at::Tensor();
    root.zero_grad();
    i = 0;
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(test::within_bound(item.value().detach().cpu(),
                                     piece(ref_params[i].detach().cpu(), i),
                                     piece(param_bounds[i], i)))
          << item.key() << " after the optimizer step";
      ++i;
    }

    // The next step starts from the sharded model's parameters, gathered
    // from its shards (what the optimizer changed).
    StateDictOptions whole;
    whole.full_state_dict = true;
    whole.cpu_offload = true;
    auto ref_named = reference->named_parameters();
    at::NoGradGuard no_grad;
    for (const auto& [key, value] : get_model_state_dict(*model, whole)) {
      if (ref_named.contains(key)) ref_named[key].copy_(std::get<at::Tensor>(value).to(device));
    }
  }
}

}  // namespace hp::cuda_test
