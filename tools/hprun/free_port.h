// Picking a rendezvous port for the ranks.
#pragma once

namespace hp::launcher {

// Binds a TCP socket to 127.0.0.1 port 0, reads the port the kernel chose and
// closes the socket. The port is free now, not reserved: another process can
// take it before rank 0's store binds it (torchrun has the same race). The
// socket never listened or connected, so closing it leaves no TIME_WAIT entry
// that would block the store's bind. Throws std::runtime_error on failure.
// With `all_interfaces` (node 0 of a multi-node job, whose rank 0 serves
// other hosts) the socket is bound to 0.0.0.0 instead.
int pick_free_port(bool all_interfaces = false);

}  // namespace hp::launcher
