// DTensor demo: a tour of meshes, placements and redistribute on N local
// ranks, checked against the single-process result at every step.
//
//   hprun -n 4 build/examples/dtensor_demo
//
// On 4 ranks it uses a 2x2 mesh ("dp", "tp"), otherwise a 1-d mesh. Exits
// non-zero if any distributed result differs from the local reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <iostream>
#include <sstream>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/tensor/dtensor.h"
#include "hp/util/error.h"

namespace {

int g_checks = 0;
int g_failures = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::cerr << "MISMATCH: " << what << std::endl;
  }
}

// Rank 0 narrates; every rank checks.
void say(const std::string& text) {
  if (hp::dist::get_rank() == 0) std::cout << text << std::endl;
}

std::string shape_of(const at::Tensor& t) { return hp::to_string(t.sizes().vec()); }

int run() {
  at::set_num_threads(1);
  hp::dist::init_process_group();
  const int world = hp::dist::get_world_size();
  const bool square = world == 4;
  auto mesh = square ? hp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"})
                     : hp::init_device_mesh("cpu", {1, world}, {"dp", "tp"});
  say(hp::cat("== ", world, " ranks on ", mesh->describe()));
  {
    std::ostringstream line;
    line << "rank " << hp::dist::get_rank() << " sits at mesh coordinate "
         << hp::to_string(mesh->coordinate());
    std::cout << line.str() << std::endl;
  }
  hp::dist::barrier(*hp::dist::world_group()).wait();

  // 1. An uneven 10x6 matrix, rows over dp and columns over tp.
  at::Tensor full = at::arange(60, at::kFloat).view({10, 6});
  hp::DTensor x = hp::distribute_tensor(full, mesh, {hp::Shard(0), hp::Shard(1)});
  std::cout << "rank " << hp::dist::get_rank() << " holds rows/cols at offset "
            << hp::to_string(x.local_offset()) << ", local shape " << shape_of(x.local())
            << std::endl;
  hp::dist::barrier(*hp::dist::world_group()).wait();
  check(at::equal(x.full_tensor(), full), "full_tensor of [S(0), S(1)]");

  // 2. A walk through layouts; each step is planned per mesh dim and cached.
  const std::vector<hp::Placements> walk = {
      {hp::Replicate(), hp::Shard(1)},
      {hp::Shard(1), hp::Shard(0)},
      {hp::Shard(0), hp::Shard(0)},
      {hp::Replicate(), hp::Partial("sum")},
      {hp::Shard(0), hp::Shard(1)},
  };
  hp::DTensor current = x;
  for (const auto& target : walk) {
    say(current.explain(hp::Layout(mesh, target)));
    current = current.redistribute(target);
    check(at::equal(current.full_tensor(), full),
          "full_tensor after redistribute to " + hp::to_string(target));
  }

  // 3. Tensor parallelism by hand: a column-parallel then a row-parallel
  //    linear, Y = relu(X W1) W2, with W1 split by columns and W2 by rows over
  //    tp. The row-parallel output is Partial(sum) until it is reduced.
  at::Generator gen = at::detail::createCPUGenerator(7);
  at::Tensor X = at::randn({4, 6}, gen), W1 = at::randn({6, 8}, gen), W2 = at::randn({8, 6}, gen);
  at::Tensor w1 = hp::distribute_tensor(W1, mesh, {hp::Replicate(), hp::Shard(1)})
                      .local()
                      .clone()
                      .requires_grad_(true);
  at::Tensor w2 = hp::distribute_tensor(W2, mesh, {hp::Replicate(), hp::Shard(0)})
                      .local()
                      .clone()
                      .requires_grad_(true);
  at::Tensor hidden = at::relu(X.matmul(w1));  // [4, 8/tp], Shard(1) on tp
  hp::DTensor partial = hp::from_local(hidden.matmul(w2), mesh, {hp::Replicate(), hp::Partial()});
  hp::DTensor y = partial.redistribute({hp::Replicate(), hp::Replicate()});
  at::Tensor reference = at::relu(X.matmul(W1)).matmul(W2);
  check(at::allclose(y.to_local(), reference, 1e-5, 1e-6), "tensor-parallel MLP output");
  say(hp::cat("tensor-parallel MLP: Y = relu(X W1) W2 with W1 ", shape_of(W1), " split to ",
              shape_of(w1), " per rank; the row-parallel product is ",
              hp::to_string(partial.placements()), " and one all_reduce gives Y ",
              shape_of(y.local())));

  // Gradients flow back through the all-reduce: each rank gets the gradient
  // of its own weight shard.
  y.to_local().sum().backward();
  at::Tensor W1r = W1.clone().requires_grad_(true), W2r = W2.clone().requires_grad_(true);
  at::relu(X.matmul(W1r)).matmul(W2r).sum().backward();
  auto shard_of = [&](const at::Tensor& t, hp::Placements p) {
    return hp::distribute_tensor(t, mesh, p).local();
  };
  check(at::allclose(w1.grad(), shard_of(W1r.grad(), {hp::Replicate(), hp::Shard(1)}), 1e-5, 1e-6),
        "gradient of the column-parallel weight shard");
  check(at::allclose(w2.grad(), shard_of(W2r.grad(), {hp::Replicate(), hp::Shard(0)}), 1e-5, 1e-6),
        "gradient of the row-parallel weight shard");

  // Everyone agrees on the verdict before reporting it.
  at::Tensor failures = at::full({1}, float(g_failures));
  hp::dist::all_reduce(*hp::dist::world_group(), failures).wait();
  const int total_failures = static_cast<int>(failures.item<float>());
  say(hp::cat("== ", g_checks, " checks per rank against the single-process result: ",
              total_failures == 0 ? "all equal" : "FAILURES", " (", total_failures,
              " mismatches across ranks)"));
  hp::dist::destroy_process_group();
  return total_failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const hp::ArgumentError& e) {
    // Started without a launcher, or a launcher's environment that does not
    // add up: a usage error, as with hprun and hp-train.
    std::cerr << "dtensor_demo: error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dtensor_demo: " << hp::exception_message(e) << std::endl;
    return 1;
  }
}
