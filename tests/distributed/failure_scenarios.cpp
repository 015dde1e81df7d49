// A program for the failure-propagation tests: run under hprun, one rank
// misbehaves and the job must end non-zero with a message, never hang.
//
//   failure_scenarios die     rank 1 exits with status 3 at once (as a crash would:
//                             no destructors, the kernel closes its sockets)
//   failure_scenarios hang    rank 1 sleeps; the others time out in all_reduce
//   failure_scenarios sum     no failure: all_reduce of ranks, checked
//   failure_scenarios p2p_peer_dies    rank 1 exits with status 3 at once while
//                             rank 0 receives from it (other ranks exit 0)
//   failure_scenarios p2p_peer_hangs   rank 1 sleeps; rank 0's receive from it
//                             times out
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "hp/distributed/collectives.h"
#include "hp/distributed/p2p.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  hp::dist::init_process_group();
  const int rank = hp::dist::get_rank(), world = hp::dist::get_world_size();
  const bool p2p = mode == "p2p_peer_dies" || mode == "p2p_peer_hangs";
  if (rank == 1 && (mode == "die" || mode == "p2p_peer_dies")) std::_Exit(3);
  if (rank == 1 && (mode == "hang" || mode == "p2p_peer_hangs")) {
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  if (p2p) {
    // Only rank 0 waits on the peer; the message must be its own.
    if (rank != 0) return 0;
    try {
      at::Tensor in = at::zeros({4});
      hp::dist::recv(*hp::dist::world_group(), in, 1).wait();
      std::cerr << "recv from a failed peer returned" << std::endl;
      return 1;
    } catch (const hp::CollectiveError& e) {
      std::cerr << "CollectiveError: " << e.what() << std::endl;
      return 1;
    }
  }
  try {
    at::Tensor t = at::full({4}, float(rank));
    hp::dist::all_reduce(*hp::dist::world_group(), t).wait();
    const float expected = world * (world - 1) / 2.0f;
    if (t[0].item<float>() != expected) {
      std::cerr << "wrong sum " << t[0].item<float>() << ", expected " << expected << std::endl;
      return 1;
    }
    std::cout << "rank " << rank << " of " << world << " (local rank "
              << hp::dist::launch_env().local_rank << "): all_reduce sum " << expected
              << std::endl;
  } catch (const hp::CollectiveError& e) {
    std::cerr << "CollectiveError: " << e.what() << std::endl;
    return 1;
  }
  hp::dist::destroy_process_group();
  return 0;
}
