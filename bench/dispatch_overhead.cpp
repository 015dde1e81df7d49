// What one op on a tensor-form DTensor costs beyond the same op on its local
// shard: tiny tensors (8 elements), so the op itself is almost free and the
// difference is the dispatcher's detour, the rule and the wrapping. Measured
// for an element-wise add (Replicate and Shard inputs, no communication),
// a matmul (column-parallel pattern) and a view (a rule that rewrites
// global sizes), each interleaved with the plain op in chunks so that load
// drifts alike over both.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bench/bench_config.h"
#include "bench/bench_worker.h"
#include "bench/median.h"
#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"

namespace hp::bench {

namespace {

using Clock = std::chrono::steady_clock;

// Median over chunks of (DTensor chunk median - plain chunk median), per op.
double overhead_us(const std::function<at::Tensor()>& plain,
                   const std::function<at::Tensor()>& dtensor, int64_t ops) {
  const int64_t chunk = 200;
  std::vector<double> diffs;
  auto time_chunk = [&](const std::function<at::Tensor()>& fn) {
    std::vector<double> each;
    for (int64_t i = 0; i < chunk; ++i) {
      const auto t0 = Clock::now();
      at::Tensor r = fn();
      each.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return median(each);
  };
  for (int i = 0; i < 2; ++i) {
    time_chunk(plain);
    time_chunk(dtensor);
  }
  for (int64_t done = 0; done < ops; done += chunk) {
    const double p = time_chunk(plain);
    const double d = time_chunk(dtensor);
    diffs.push_back(d - p);
  }
  return median(diffs) * 1e6;
}

}  // namespace

int run_dispatch_worker(const BenchConfig& c) {
  at::set_num_threads(1);
  dist::init_process_group();
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
  const int64_t world = mesh->size();
  torch::manual_seed(c.seed);
  torch::NoGradGuard no_grad;
  at::Tensor a = torch::randn({8 * world}), b = torch::randn({8 * world});
  at::Tensor x = torch::randn({2, 4}), w = torch::randn({4, 2 * world});
  const Layout rep(mesh, {Replicate()}), row(mesh, {Shard(0)}), col(mesh, {Shard(1)});
  at::Tensor ar = distribute(a, rep), br = distribute(b, rep);
  at::Tensor as = distribute(a, row), bs = distribute(b, row);
  at::Tensor xr = distribute(x, rep), wc = distribute(w, col);
  const at::Tensor al = local_of(as), bl = local_of(bs), wl = local_of(wc);
  const int64_t ops = c.hook_steps * 25;

  nlohmann::json out;
  out["world_size"] = world;
  out["what"] = "extra time per op of a tensor-form DTensor over the same op on its local "
                "shard (tiny tensors, no communication): median over chunks of 200 ops of "
                "(DTensor chunk median - plain chunk median)";
  out["ops_timed"] = ops;
  nlohmann::json cases = nlohmann::json::object();
  cases["add_replicate"] =
      overhead_us([&] { return a + b; }, [&] { return ar + br; }, ops);
  cases["add_shard"] = overhead_us([&] { return al + bl; }, [&] { return as + bs; }, ops);
  cases["mm_column_parallel"] =
      overhead_us([&] { return x.mm(wl); }, [&] { return xr.mm(wc); }, ops);
  cases["view_shard"] = overhead_us([&] { return al.view({2, -1}); },
                                    [&] { return as.view({2 * world, -1}); }, ops);
  out["overhead_us_per_op"] = cases;
  double worst = 0;
  for (const auto& [name, v] : cases.items()) worst = std::max(worst, v.get<double>());
  out["worst_overhead_us_per_op"] = worst;
  if (dist::get_rank() == 0) std::cout << kResultMarker << out.dump() << std::endl;
  dist::destroy_process_group();
  return 0;
}

}  // namespace hp::bench
