#include "tools/hprun/line_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace hp::launcher {
namespace {

void make_non_blocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace

LineChannel::LineChannel(int fd) : fd_(fd), last_heard_(Clock::now()) {
  make_non_blocking(fd_);
  int one = 1;
  // Short lines that must arrive now, not when Nagle sees fit.
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

LineChannel::~LineChannel() {
  if (fd_ >= 0) ::close(fd_);
}

short LineChannel::events() const {
  if (closed_) return 0;
  return static_cast<short>(POLLIN | (out_.empty() ? 0 : POLLOUT));
}

void LineChannel::fail(const std::string& why) {
  if (closed_) return;
  closed_ = true;
  why_closed_ = why;
}

void LineChannel::on_poll(short revents) {
  if (closed_ || revents == 0) return;
  if (revents & (POLLIN | POLLHUP | POLLERR)) {
    char buffer[4096];
    // Bounded: what is left waits for the next poll, which reports it again.
    for (std::size_t read = 0; read < kMaxReadPerPoll;) {
      ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n > 0) {
        last_heard_ = Clock::now();
        read += static_cast<std::size_t>(n);
        if (!in_.append(buffer, static_cast<std::size_t>(n))) {
          fail(in_.error());
          break;
        }
        if (closing_) {
          for (std::string dropped; in_.next_line(&dropped);) {
          }
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      fail(n == 0 ? "connection closed" : std::string("connection broken: ") +
                                              std::strerror(errno));
      break;
    }
  }
  if (!closed_ && !out_.empty() && (revents & POLLOUT)) {
    ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL);
    if (n > 0) {
      out_.erase(0, static_cast<std::size_t>(n));
    } else if (n < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
      fail(std::string("connection broken: ") + std::strerror(errno));
    }
  }
  if (closing_) flush_and_half_close();
}

void LineChannel::close_when_sent() {
  closing_ = true;
  flush_and_half_close();
}

void LineChannel::flush_and_half_close() {
  if (closed_ || half_closed_ || !out_.empty()) return;
  ::shutdown(fd_, SHUT_WR);
  half_closed_ = true;
}

void LineChannel::send(const std::string& line) {
  if (closed_) return;
  out_ += line;
  out_ += '\n';
  // Most lines go at once; the rest waits for POLLOUT.
  ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL);
  if (n > 0) out_.erase(0, static_cast<std::size_t>(n));
}

bool LineChannel::next_line(std::string* line) { return in_.next_line(line); }

void LineChannel::close_all(const std::vector<LineChannel*>& channels, double limit_s) {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(limit_s));
  std::vector<bool> half_closed(channels.size(), false);
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<LineChannel*> polled;
    for (std::size_t i = 0; i < channels.size(); ++i) {
      LineChannel* c = channels[i];
      if (c->closed_) continue;
      if (c->out_.empty() && !half_closed[i]) {
        ::shutdown(c->fd_, SHUT_WR);
        half_closed[i] = true;
      }
      fds.push_back({c->fd_, c->events(), 0});
      polled.push_back(c);
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (fds.empty() || left.count() <= 0) return;
    if (::poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) continue;
    for (std::size_t i = 0; i < fds.size(); ++i) polled[i]->on_poll(fds[i].revents);
  }
}

int listen_on_port(const std::string& bind_address, int port) {
  const std::string where = bind_address + ":" + std::to_string(port);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, bind_address.c_str(), &addr.sin_addr) != 1) {
    throw std::runtime_error("cannot listen on " + where +
                             " for the other nodes: not an IPv4 address");
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw std::runtime_error(std::string("cannot create a socket: ") + strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, 64) != 0) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot listen on " + where + " for the other nodes: " +
                             std::strerror(err));
  }
  return fd;
}

int accept_connection(int listen_fd, std::string* peer_address) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
  if (fd < 0) return -1;
  char text[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof(text));
  *peer_address = text;
  return fd;
}

int start_connect(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw std::runtime_error("cannot resolve --master-addr '" + host + "': " + gai_strerror(rc));
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    ::freeaddrinfo(found);
    throw std::runtime_error(std::string("cannot create a socket: ") + std::strerror(errno));
  }
  // EINPROGRESS is the normal answer; any other error shows in connect_error.
  ::connect(fd, found->ai_addr, found->ai_addrlen);
  ::freeaddrinfo(found);
  return fd;
}

int connect_error(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  if (err != 0) return err;
  sockaddr_in peer{};
  socklen_t peer_len = sizeof(peer);
  // Writable without SO_ERROR yet no peer: the connect did not complete.
  return ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0 ? 0 : ENOTCONN;
}

}  // namespace hp::launcher
