// Collectives benchmark (not a test): bus bandwidth of the facade's
// all-gather and reduce-scatter against c10d's own allgather moving the same
// bytes, side by side in one run.
//
//   hprun -n 2 build/bench/bench_collectives --json out/collectives.json
//
// For a buffer of B bytes (fp32): all_gather fills B from B/n per rank;
// reduce_scatter reduces B into B/n per rank; raw_c10d_allgather is
// ProcessGroupGloo::allgather into n separate tensors of B/n. Each timed op
// starts after a barrier; its time is the slowest rank's; the figure is the
// median over the iterations. Bus bandwidth follows nccl-tests:
// busbw = B / time * (n - 1) / n for both ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>

#include "bench/median.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"

namespace {

using Clock = std::chrono::steady_clock;

double slowest(double seconds) {
  at::Tensor t = at::full({1}, seconds, at::kDouble);
  hp::dist::all_reduce(*hp::dist::world_group(), t, hp::dist::ReduceOp::kMax).wait();
  return t.item<double>();
}

using hp::bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Bus bandwidth of hp's all_gather / reduce_scatter vs raw c10d allgather"};
  std::string json_path = "collectives.json";
  int64_t min_bytes = 4 << 10, max_bytes = 64 << 20;
  int max_iters = 200;
  app.add_option("--json", json_path, "where to write the results");
  app.add_option("--min-bytes", min_bytes, "smallest buffer (bytes)");
  app.add_option("--max-bytes", max_bytes, "largest buffer (bytes)");
  app.add_option("--max-iters", max_iters, "iterations for the smallest buffer");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  hp::dist::init_process_group();
  auto& world = *hp::dist::world_group();
  const int n = world.size();
  const bool lead = world.rank() == 0;
  nlohmann::json rows = nlohmann::json::array();
  nlohmann::json ratios = nlohmann::json::array();
  if (lead) {
    std::printf("%10s %22s %12s %12s %12s\n", "bytes", "op", "median_us", "algbw_GB/s",
                "busbw_GB/s");
  }
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t numel = bytes / 4 / n * n;
    const int64_t piece = numel / n;
    // Fewer iterations for big buffers: ~constant bytes moved per size.
    const int iters = std::max<int>(5, std::min<int64_t>(max_iters, (256ll << 20) / bytes));
    at::Tensor full = at::randn({numel});
    at::Tensor in_piece = at::randn({piece});
    at::Tensor out_piece = at::empty({piece});
    std::vector<at::Tensor> raw_outputs;
    for (int r = 0; r < n; ++r) raw_outputs.push_back(at::empty({piece}));

    struct Op {
      const char* name;
      std::function<void()> run;
      std::vector<double> times;
    };
    std::vector<Op> ops = {
        {"all_gather", [&] { hp::dist::all_gather_into(world, full, in_piece).wait(); }, {}},
        {"reduce_scatter", [&] { hp::dist::reduce_scatter(world, out_piece, full).wait(); }, {}},
        {"raw_c10d_allgather",
         [&] {
           std::vector<std::vector<at::Tensor>> outputs{raw_outputs};
           std::vector<at::Tensor> inputs{in_piece};
           world.process_group().allgather(outputs, inputs)->wait();
         },
         {}},
    };
    for (auto& op : ops) op.run();  // warm-up: connections, allocator, caches
    // Interleaved, so drift in machine load hits every op alike.
    for (int i = 0; i < iters; ++i) {
      for (auto& op : ops) {
        hp::dist::barrier(world).wait();
        auto t0 = Clock::now();
        op.run();
        op.times.push_back(slowest(std::chrono::duration<double>(Clock::now() - t0).count()));
      }
    }
    std::map<std::string, double> medians;
    for (auto& op : ops) {
      const double t = median(op.times);
      medians[op.name] = t;
      const double algbw = numel * 4.0 / t / 1e9;
      const double busbw = algbw * (n - 1) / n;
      rows.push_back({{"op", op.name}, {"bytes", numel * 4}, {"iterations", iters},
                      {"median_s", t}, {"algbw_GBps", algbw}, {"busbw_GBps", busbw}});
      if (lead) {
        std::printf("%10lld %22s %12.1f %12.3f %12.3f\n", static_cast<long long>(numel * 4),
                    op.name, t * 1e6, algbw, busbw);
      }
    }
    ratios.push_back({{"bytes", numel * 4},
                      {"reduce_scatter_over_all_gather",
                       medians["reduce_scatter"] / medians["all_gather"]},
                      {"all_gather_over_raw_c10d",
                       medians["all_gather"] / medians["raw_c10d_allgather"]}});
  }
  if (lead) {
    // Geometric means over sizes summarise the two targets in one number each.
    double log_rs = 0, log_ag = 0;
    for (const auto& r : ratios) {
      log_rs += std::log(r["reduce_scatter_over_all_gather"].get<double>());
      log_ag += std::log(r["all_gather_over_raw_c10d"].get<double>());
    }
    const double count = static_cast<double>(ratios.size());
    nlohmann::json summary = {
        {"reduce_scatter_over_all_gather_geomean", std::exp(log_rs / count)},
        {"all_gather_over_raw_c10d_geomean", std::exp(log_ag / count)}};
    nlohmann::json out = {
        {"config",
         {{"ranks", n}, {"dtype", "float32"}, {"backend", "gloo (libtorch 1.13.1)"},
          {"transport", hp::dist::launch_env().master_addr}, {"torch_threads", 1}}},
        {"rows", rows},
        {"ratios", ratios},
        {"summary", summary}};
    std::ofstream(json_path) << out.dump(2) << "\n";
    std::cout << "ratios (median time): reduce_scatter / all_gather and all_gather / raw c10d\n";
    for (const auto& r : ratios) {
      std::printf("%10lld %8.3f %8.3f\n", static_cast<long long>(r["bytes"].get<int64_t>()),
                  r["reduce_scatter_over_all_gather"].get<double>(),
                  r["all_gather_over_raw_c10d"].get<double>());
    }
    std::printf("geometric means: reduce_scatter/all_gather %.3f, all_gather/raw c10d %.3f\n",
                summary["reduce_scatter_over_all_gather_geomean"].get<double>(),
                summary["all_gather_over_raw_c10d_geomean"].get<double>());
    std::cout << "wrote " << json_path << std::endl;
  }
  hp::dist::destroy_process_group();
  return 0;
}
