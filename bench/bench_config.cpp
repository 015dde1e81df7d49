#include "bench/bench_config.h"

#include <fmt/format.h>

namespace hp::bench {

namespace {

// The shortest text that reads back as exactly `v`.
std::string str(double v) { return fmt::format("{}", v); }

}  // namespace

const std::vector<std::string>& gpu_row_names() {
  static const std::vector<std::string> rows = {"single",      "ddp",          "fsdp_fused_prefetch",
                                                "hsdp_fused_prefetch", "torch_single", "torch_ddp",
                                                "torch_fsdp2"};
  return rows;
}

nn::GPTConfig BenchConfig::gpt_config(int64_t layers, int64_t d) const {
  nn::GPTConfig config;
  config.vocab_size = vocab;
  config.context = ctx;
  config.n_layer = layers;
  config.n_head = heads;
  config.n_embd = d;
  return config;
}

std::vector<std::string> BenchConfig::worker_args() const {
  std::vector<std::string> args;
  args = {"--vocab",        std::to_string(vocab),
          "--seq",          std::to_string(seq),
          "--d",            std::to_string(d),
          "--heads",        std::to_string(heads),
          "--layers",       std::to_string(layers),
          "--ctx",          std::to_string(ctx),
          "--batch",        std::to_string(batch),
          "--lr",           str(lr),
          "--beta1",        str(beta1),
          "--beta2",        str(beta2),
          "--eps",          str(eps),
          "--weight-decay", str(weight_decay),
          "--seed",         std::to_string(seed),
          "--worker-steps", std::to_string(steps),
          "--warmup",       std::to_string(warmup),
          "--tokens",       tokens_path,
          "--hook-units",   std::to_string(hook_units),
          "--hook-width",   std::to_string(hook_width),
          "--hook-batch",   std::to_string(hook_batch),
          "--hook-steps",   std::to_string(hook_steps),
          "--ckpt-layers",  std::to_string(ckpt_layers),
          "--ckpt-d",       std::to_string(ckpt_d),
          "--ckpt-dir",     ckpt_dir,
          "--ckpt-repeats", std::to_string(ckpt_repeats),
          "--pp-layers",    std::to_string(pp_layers),
          "--pp-microbatches", std::to_string(pp_microbatches),
          "--pp-split",     pp_split};
  args.insert(args.end(), {"--device", device, "--param-dtype", param_dtype});
  if (!reduce_dtype.empty()) args.insert(args.end(), {"--reduce-dtype", reduce_dtype});
  if (!profile_ops_dir.empty()) {
    args.push_back("--profile-ops");
    args.push_back(profile_ops_dir);
  }
  return args;
}

}  // namespace hp::bench
