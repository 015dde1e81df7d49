// Picking a rendezvous port for a single-node job.
#pragma once

namespace hp::launcher {

// Binds a TCP socket to 127.0.0.1 port 0, reads the port the kernel chose and
// closes the socket. The port is free now, not reserved: another process can
// take it before rank 0's store binds it (torchrun has the same race). The
// socket never listened or connected, so closing it leaves no TIME_WAIT entry
// that would block the store's bind. Throws std::runtime_error on failure.
int pick_free_port();

}  // namespace hp::launcher
