// A TCP connection between two hprun agents carrying text lines (the agents'
// protocol, agents.h). Non-blocking: the owner's poll() loop asks for
// events(), then calls on_poll(); nothing here waits, except close_all's
// bounded goodbye. What a peer can make it hold is bounded: a line longer
// than kMaxLineBytes breaks the connection, and one on_poll reads at most
// kMaxReadPerPoll bytes, so a flooding peer cannot keep the loop reading.
// Not thread-safe.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "tools/hprun/agent_protocol.h"

namespace hp::launcher {

class LineChannel {
 public:
  using Clock = std::chrono::steady_clock;

  // Takes ownership of a connected socket and makes it non-blocking.
  explicit LineChannel(int fd);
  ~LineChannel();
  LineChannel(const LineChannel&) = delete;
  LineChannel& operator=(const LineChannel&) = delete;

  int fd() const { return fd_; }
  // POLLIN, plus POLLOUT while output is queued.
  short events() const;
  // Reads what arrived and writes what it can.
  void on_poll(short revents);

  // Queues `line` (without its newline, which must not occur in it).
  void send(const std::string& line);
  // The next complete line received, if any.
  bool next_line(std::string* line);

  // The peer closed the connection or it broke; why_closed() says which.
  bool closed() const { return closed_; }
  const std::string& why_closed() const { return why_closed_; }
  // When a line (or any byte) last arrived.
  Clock::time_point last_heard() const { return last_heard_; }

  // Sends what is queued, then half-closes, from the owner's poll loop:
  // call on_poll as usual until closed() (the peer's end) or the owner's
  // own deadline. Lines that still arrive are dropped.
  void close_when_sent();

  // Sends what is queued, half-closes and waits for the peers' end, at most
  // `limit_s`: a peer reading its last message must not find it cut off by
  // a reset.
  static void close_all(const std::vector<LineChannel*>& channels, double limit_s);

 private:
  void fail(const std::string& why);

  void flush_and_half_close();

  int fd_;
  std::string out_;
  LineBuffer in_;
  bool closing_ = false, half_closed_ = false;
  bool closed_ = false;
  std::string why_closed_;
  Clock::time_point last_heard_;
};

constexpr std::size_t kMaxReadPerPoll = 64 * 1024;

// A non-blocking socket listening at bind_address:port (SO_REUSEADDR);
// bind_address is an IPv4 address, "0.0.0.0" for every interface. Throws
// std::runtime_error naming the address and port.
int listen_on_port(const std::string& bind_address, int port);

// A connection accepted from `listen_fd`, or -1 when none is pending.
int accept_connection(int listen_fd, std::string* peer_address);

// Starts a non-blocking connect to host:port (IPv4). Returns the socket;
// connect_error() tells how it went once poll() reports it writable. Throws
// std::runtime_error when `host` does not resolve.
int start_connect(const std::string& host, int port);
// 0 once connected, else the errno of the failed connect.
int connect_error(int fd);

}  // namespace hp::launcher
