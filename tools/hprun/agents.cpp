#include "tools/hprun/agents.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tools/hprun/exit_status.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/line_channel.h"

namespace hp::launcher {
namespace {

void earliest(std::optional<Clock::time_point>* next, std::optional<Clock::time_point> t) {
  if (t && (!*next || *t < **next)) *next = t;
}

// kEnding: true once this node's ranks are gone (then `end_code` is the
// job's); false while they run.
bool ranks_ended(Attempt* attempt, bool interrupted, int* end_code) {
  if (attempt && !attempt->done()) return false;
  if (attempt) {
    attempt->finish();
    // Ranks that caught a forwarded signal and exited 0 ended cleanly.
    if (interrupted && attempt->interrupted_by() != 0) *end_code = attempt->exit_code(*end_code);
  }
  return true;
}

// "FAILED 3 1 rank 2 (pid 7) exited with status 3" -> its first `words`
// words, then the rest of the line (possibly empty) as one more field.
std::vector<std::string> fields(const std::string& line, std::size_t words) {
  std::vector<std::string> result;
  std::size_t pos = 0;
  while (result.size() < words) {
    std::size_t space = line.find(' ', pos);
    result.push_back(line.substr(pos, space - pos));
    if (space == std::string::npos) {
      pos = line.size();
      break;
    }
    pos = space + 1;
  }
  result.resize(words);  // a short line: the missing words are empty
  result.push_back(pos < line.size() ? line.substr(pos) : "");
  return result;
}

bool parse_int(const std::string& text, int* value) {
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  *value = std::stoi(text);
  return true;
}

std::string node_name(int node) { return "node " + std::to_string(node); }

// Node 0: serves the agents' rendezvous and decides about every attempt.
class Coordinator {
 public:
  explicit Coordinator(JobContext& job)
      : job_(job), peers_(static_cast<std::size_t>(job.options.nnodes)) {}
  int run();

 private:
  struct Peer {
    std::unique_ptr<LineChannel> channel;
    std::string address;
    bool ready = false;  // joined, no ranks running: can start an attempt
    bool done = false;   // every rank of this attempt exited 0
  };
  enum class Phase { kJoining, kRunning, kEnding };

  void poll_round();
  void on_join(std::unique_ptr<LineChannel> channel, const std::string& address,
               const std::string& line);
  void on_message(int node, const std::string& line);
  void on_gone(int node, const std::string& why);
  void on_interrupt(int signo);
  void on_failure(const std::string& what, int code, bool restartable, Clock::time_point when);
  void step(Clock::time_point now);
  void start_attempt();
  void end(int code);
  void tell(const std::string& line);
  void broadcast(const std::string& line);
  std::string missing_nodes() const;

  JobContext& job_;
  int listen_fd_ = -1;
  std::vector<Peer> peers_;  // by node rank; [0] is this node and unused
  std::vector<std::pair<std::unique_ptr<LineChannel>, std::string>> unjoined_;
  std::unique_ptr<Attempt> attempt_;
  Phase phase_ = Phase::kJoining;
  int restart_count_ = 0;  // of the attempt running, or being joined
  int ranks_port_ = 0;
  Clock::time_point join_deadline_;
  Clock::time_point next_heartbeat_;
  bool local_done_ = false;
  bool interrupted_ = false;
  bool finished_ = false;
  int end_code_ = 0;
};

int Coordinator::run() {
  try {
    listen_fd_ = listen_on_port(job_.options.master_port);
  } catch (const std::exception& e) {
    job_.say(e.what());
    return kExitSetupFailed;
  }
  join_deadline_ = after(Clock::now(), job_.options.rdzv_timeout_s);
  next_heartbeat_ = Clock::now();
  while (!finished_) poll_round();
  ::close(listen_fd_);
  std::vector<LineChannel*> channels;
  for (Peer& peer : peers_) {
    if (peer.channel) channels.push_back(peer.channel.get());
  }
  for (auto& pending : unjoined_) channels.push_back(pending.first.get());
  LineChannel::close_all(channels, 1.0);
  return end_code_;
}

void Coordinator::poll_round() {
  std::vector<pollfd> fds{{job_.signals.fd(), POLLIN, 0}, {listen_fd_, POLLIN, 0}};
  for (auto& pending : unjoined_) fds.push_back({pending.first->fd(), pending.first->events(), 0});
  std::vector<int> polled_peers;
  for (std::size_t n = 1; n < peers_.size(); ++n) {
    if (!peers_[n].channel) continue;
    fds.push_back({peers_[n].channel->fd(), peers_[n].channel->events(), 0});
    polled_peers.push_back(static_cast<int>(n));
  }
  const std::size_t attempt_at = fds.size();
  if (attempt_) attempt_->append_fds(&fds);

  std::optional<Clock::time_point> next = next_heartbeat_;
  if (attempt_) earliest(&next, attempt_->next_deadline());
  if (phase_ != Phase::kEnding) earliest(&next, job_.deadline);
  if (phase_ == Phase::kJoining) earliest(&next, join_deadline_);
  if (::poll(fds.data(), fds.size(), poll_wait_ms(next)) < 0 && errno != EINTR) {
    job_.say(std::string("poll failed: ") + std::strerror(errno));
  }
  Clock::time_point now = Clock::now();
  if (attempt_) attempt_->on_poll(fds.data() + attempt_at);
  if (fds[0].revents != 0) {
    for (int signo : job_.signals.drain()) {
      if (signo == SIGINT || signo == SIGTERM) on_interrupt(signo);
    }
  }
  if (fds[1].revents != 0) {
    std::string address;
    for (int fd; (fd = accept_connection(listen_fd_, &address)) >= 0;) {
      unjoined_.emplace_back(std::make_unique<LineChannel>(fd), address);
    }
  }
  std::size_t at = 2;
  std::vector<std::pair<std::unique_ptr<LineChannel>, std::string>> still_unjoined;
  for (auto& pending : unjoined_) {
    pending.first->on_poll(fds[at++].revents);
    std::string line;
    const bool silent = now > after(pending.first->last_heard(), job_.config.peer_silence_s);
    if (pending.first->next_line(&line)) {
      on_join(std::move(pending.first), pending.second, line);
    } else if (!pending.first->closed() && !silent) {
      still_unjoined.push_back(std::move(pending));
    }
  }
  unjoined_ = std::move(still_unjoined);
  for (int n : polled_peers) {
    const short revents = fds[at++].revents;
    LineChannel* channel = peers_[n].channel.get();
    if (!channel) continue;  // gone while handling an earlier node
    channel->on_poll(revents);
    std::string line;
    while (peers_[n].channel && channel->next_line(&line)) on_message(n, line);
    if (peers_[n].channel && channel->closed()) on_gone(n, channel->why_closed());
  }
  if (attempt_) attempt_->check(now);
  if (now >= next_heartbeat_) {
    broadcast("HB");
    next_heartbeat_ = after(now, job_.config.heartbeat_s);
  }
  for (std::size_t n = 1; n < peers_.size(); ++n) {
    if (peers_[n].channel &&
        now > after(peers_[n].channel->last_heard(), job_.config.peer_silence_s)) {
      on_gone(static_cast<int>(n), "no message for " + seconds_text(job_.config.peer_silence_s));
    }
  }
  if (phase_ != Phase::kEnding && job_.deadline && now >= *job_.deadline) {
    tell(job_.timeout_message() + "; ending the job on every node");
    end(kExitTimeout);
  }
  step(now);
}

void Coordinator::on_join(std::unique_ptr<LineChannel> channel, const std::string& address,
                          const std::string& line) {
  std::vector<std::string> f = fields(line, 5);
  int node = -1, nnodes = -1, nproc = -1, max_restarts = -1;
  std::string problem;
  const LaunchOptions& o = job_.options;
  if (f[0] != "JOIN" || !parse_int(f[1], &node) || !parse_int(f[2], &nnodes) ||
      !parse_int(f[3], &nproc) || !parse_int(f[4], &max_restarts)) {
    problem = "a connection from " + address + " is not an hprun agent (it sent '" +
              line.substr(0, 80) + "')";
  } else if (nnodes != o.nnodes || nproc != o.nproc_per_node || max_restarts != o.max_restarts) {
    // The ranks' world (and TORCHELASTIC_MAX_RESTARTS) must be the same on every node.
    auto flags = [](int k, int n, int r) {
      return "--nnodes " + std::to_string(k) + " -n " + std::to_string(n) + " --max-restarts " +
             std::to_string(r);
    };
    problem = node_name(node) + " (" + address + ") was started with " +
              flags(nnodes, nproc, max_restarts) + ", node 0 with " +
              flags(o.nnodes, o.nproc_per_node, o.max_restarts);
  } else if (node < 1 || node >= job_.options.nnodes) {
    problem = "an agent at " + address + " claims to be " + node_name(node);
  } else if (peers_[node].channel) {
    problem = node_name(node) + " joined again from " + address + " while " +
              peers_[node].address + " is connected as " + node_name(node);
  }
  if (!problem.empty()) {
    job_.say(problem + "; turning it away");
    channel->send("SAY node 0 turned this agent away: " + problem);
    channel->send("END " + std::to_string(kExitUsage));
    LineChannel::close_all({channel.get()}, 0.2);
    return;
  }
  Peer& peer = peers_[node];
  peer.channel = std::move(channel);
  peer.address = address;
  peer.ready = true;
  peer.done = false;
  if (phase_ == Phase::kEnding) peer.channel->send("END " + std::to_string(end_code_));
}

void Coordinator::on_message(int node, const std::string& line) {
  Peer& peer = peers_[node];
  std::vector<std::string> f = fields(line, 1);
  if (f[0] == "HB") return;
  if (f[0] == "READY") {
    peer.ready = true;
  } else if (f[0] == "DONE") {
    peer.done = true;
  } else if (f[0] == "FAILED") {
    f = fields(line, 3);
    int code = 1, restartable = 0;
    if (!parse_int(f[1], &code) || !parse_int(f[2], &restartable)) code = 1;
    on_failure(f[3] + " on " + node_name(node), code, restartable == 1, Clock::now());
  } else {
    job_.say(node_name(node) + " sent an unknown message: " + line.substr(0, 80));
  }
}

void Coordinator::on_gone(int node, const std::string& why) {
  Peer& peer = peers_[node];
  std::string what = node_name(node) + " (" + peer.address + ") is gone: " + why;
  peer.channel.reset();
  peer.ready = false;
  peer.done = false;
  if (phase_ == Phase::kRunning) {
    on_failure(what, kExitSetupFailed, true, Clock::now());
  } else if (phase_ == Phase::kJoining) {
    job_.say(what);
  }
}

void Coordinator::on_interrupt(int signo) {
  if (attempt_ && !attempt_->done()) attempt_->on_signal(signo);
  if (interrupted_) return;
  interrupted_ = true;
  if (phase_ == Phase::kEnding) return;
  std::string line = "node 0 received " + signal_name(signo) + "; ending the job";
  if (!attempt_ || attempt_->done()) job_.say(line);
  broadcast("SAY " + line);
  end(128 + signo);
}

void Coordinator::on_failure(const std::string& what, int code, bool restartable,
                             Clock::time_point when) {
  if (phase_ == Phase::kEnding) return;
  // A failure reported after the attempt was stopped is its teardown's echo;
  // only a node that cannot go on (interrupted, past --timeout) still counts.
  if (phase_ == Phase::kJoining && restartable) return;
  const int max = job_.options.max_restarts;
  std::string line = what + " at " + job_.at(when);
  if (phase_ == Phase::kRunning && restartable && !interrupted_ && restart_count_ < max) {
    ++restart_count_;
    tell("restart " + std::to_string(restart_count_) + "/" + std::to_string(max) + ": " + line);
    broadcast("STOP");
    if (!attempt_->done()) attempt_->stop("");
    for (Peer& peer : peers_) {
      peer.ready = false;
      peer.done = false;
    }
    local_done_ = false;
    phase_ = Phase::kJoining;
    join_deadline_ = after(Clock::now(), job_.options.rdzv_timeout_s);
    return;
  }
  tell(line);
  if (restartable && max > 0) {
    tell("no restarts left: " + std::to_string(max) + " of " + std::to_string(max) + " used");
  }
  end(code);
}

void Coordinator::step(Clock::time_point now) {
  switch (phase_) {
    case Phase::kJoining: {
      if (attempt_) {
        if (!attempt_->done()) return;
        attempt_->finish();
        attempt_.reset();
      }
      bool all_ready = true;
      for (std::size_t n = 1; n < peers_.size(); ++n) {
        all_ready = all_ready && peers_[n].channel && peers_[n].ready;
      }
      if (all_ready) {
        start_attempt();
      } else if (now >= join_deadline_) {
        tell(missing_nodes() + " did not join " +
             (restart_count_ == 0 ? std::string("the job")
                                  : "restart " + std::to_string(restart_count_)) +
             " within " + seconds_text(job_.options.rdzv_timeout_s));
        end(kExitSetupFailed);
      }
      return;
    }
    case Phase::kRunning: {
      if (attempt_->failed()) {
        on_failure(attempt_->failure() + " on node 0", attempt_->exit_code(kExitSetupFailed), true,
                   attempt_->failed_at());
        return;
      }
      if (attempt_->setup_failed()) {
        on_failure("node 0 could not start its ranks", kExitSetupFailed, false, now);
        return;
      }
      if (attempt_->done()) local_done_ = true;
      bool all_done = local_done_;
      for (std::size_t n = 1; n < peers_.size(); ++n) all_done = all_done && peers_[n].done;
      if (all_done) end(0);
      return;
    }
    case Phase::kEnding:
      finished_ = ranks_ended(attempt_.get(), interrupted_, &end_code_);
      return;
  }
}

void Coordinator::start_attempt() {
  int port = 0;
  try {
    // A fresh rendezvous on a fresh port: the last attempt's store may still
    // linger on its port.
    for (int tries = 0; port == 0 || (port == ranks_port_ && tries < 8); ++tries) {
      port = pick_free_port(true);
    }
  } catch (const std::exception& e) {
    tell(e.what());
    end(kExitSetupFailed);
    return;
  }
  ranks_port_ = port;
  broadcast("START " + std::to_string(restart_count_) + " " + std::to_string(port));
  attempt_ = std::make_unique<Attempt>(job_.options, job_.config, job_.out, job_.err, port,
                                       restart_count_);
  attempt_->start();
  for (Peer& peer : peers_) peer.done = false;
  local_done_ = false;
  phase_ = Phase::kRunning;
}

void Coordinator::end(int code) {
  broadcast("END " + std::to_string(code));
  if (attempt_ && !attempt_->done()) attempt_->stop("");
  end_code_ = code;
  phase_ = Phase::kEnding;
}

void Coordinator::tell(const std::string& line) {
  job_.say(line);
  broadcast("SAY " + line);
}

void Coordinator::broadcast(const std::string& line) {
  for (Peer& peer : peers_) {
    if (peer.channel) peer.channel->send(line);
  }
}

// "node 1", "nodes 1, 3"
std::string Coordinator::missing_nodes() const {
  std::vector<std::string> missing;
  for (std::size_t n = 1; n < peers_.size(); ++n) {
    if (!peers_[n].channel || !peers_[n].ready) missing.push_back(std::to_string(n));
  }
  std::string text = missing.size() == 1 ? "node " : "nodes ";
  for (std::size_t i = 0; i < missing.size(); ++i) text += (i ? ", " : "") + missing[i];
  return text;
}

// Nodes 1..K-1: does what node 0 says, reports how its ranks end.
class Follower {
 public:
  explicit Follower(JobContext& job)
      : job_(job),
        node0_("node 0 (" + job.options.master_addr + ":" +
               std::to_string(job.options.master_port) + ")") {}
  int run();

 private:
  enum class Phase { kWaiting, kRunning, kStopped, kEnding };

  bool connect();
  void poll_round();
  void on_message(const std::string& line);
  void on_interrupt(int signo);
  void step();
  void end_locally(int code);

  JobContext& job_;
  std::string node0_;
  std::unique_ptr<LineChannel> channel_;
  std::unique_ptr<Attempt> attempt_;
  Phase phase_ = Phase::kWaiting;
  bool reported_ = false;  // this attempt's outcome went to node 0
  bool interrupted_ = false;
  bool finished_ = false;
  int end_code_ = 0;
  Clock::time_point next_heartbeat_;
};

int Follower::run() {
  if (!connect()) return end_code_;
  next_heartbeat_ = Clock::now();
  while (!finished_) poll_round();
  LineChannel::close_all({channel_.get()}, 1.0);
  return end_code_;
}

bool Follower::connect() {
  const LaunchOptions& o = job_.options;
  Clock::time_point deadline = after(Clock::now(), o.rdzv_timeout_s);
  std::string last_error = "no answer";
  while (Clock::now() < deadline) {
    int fd = -1;
    try {
      fd = start_connect(o.master_addr, o.master_port);
    } catch (const std::exception& e) {
      job_.say(e.what());
      end_code_ = kExitSetupFailed;
      return false;
    }
    // Wait for the connect, then (if it failed) a little before the next.
    Clock::time_point retry_at = after(Clock::now(), 0.2);
    bool connecting = true;
    while (Clock::now() < deadline) {
      std::vector<pollfd> fds{{job_.signals.fd(), POLLIN, 0}};
      if (connecting) fds.push_back({fd, POLLOUT, 0});
      std::optional<Clock::time_point> next = deadline;
      if (!connecting) earliest(&next, retry_at);
      ::poll(fds.data(), fds.size(), poll_wait_ms(next));
      if (fds[0].revents != 0) {
        for (int signo : job_.signals.drain()) {
          if (signo != SIGINT && signo != SIGTERM) continue;
          job_.say("received " + signal_name(signo) + " while connecting to " + node0_);
          ::close(fd);
          end_code_ = 128 + signo;
          return false;
        }
      }
      if (connecting && fds[1].revents != 0) {
        int err = connect_error(fd);
        if (err == 0) {
          channel_ = std::make_unique<LineChannel>(fd);
          channel_->send("JOIN " + std::to_string(o.node_rank) + " " + std::to_string(o.nnodes) +
                         " " + std::to_string(o.nproc_per_node) + " " +
                         std::to_string(o.max_restarts));
          return true;
        }
        last_error = std::strerror(err);
        connecting = false;
      }
      if (!connecting && Clock::now() >= retry_at) break;
    }
    ::close(fd);
  }
  job_.say("cannot reach " + node0_ + " within --rdzv-timeout " +
           seconds_text(o.rdzv_timeout_s) + ": " + last_error);
  end_code_ = kExitSetupFailed;
  return false;
}

void Follower::poll_round() {
  std::vector<pollfd> fds{{job_.signals.fd(), POLLIN, 0}, {channel_->fd(), channel_->events(), 0}};
  const std::size_t attempt_at = fds.size();
  if (attempt_) attempt_->append_fds(&fds);
  std::optional<Clock::time_point> next = next_heartbeat_;
  if (attempt_) earliest(&next, attempt_->next_deadline());
  if (phase_ != Phase::kEnding) earliest(&next, job_.deadline);
  if (::poll(fds.data(), fds.size(), poll_wait_ms(next)) < 0 && errno != EINTR) {
    job_.say(std::string("poll failed: ") + std::strerror(errno));
  }
  Clock::time_point now = Clock::now();
  if (attempt_) attempt_->on_poll(fds.data() + attempt_at);
  if (fds[0].revents != 0) {
    for (int signo : job_.signals.drain()) {
      if (signo == SIGINT || signo == SIGTERM) on_interrupt(signo);
    }
  }
  channel_->on_poll(fds[1].revents);
  for (std::string line; channel_->next_line(&line);) on_message(line);
  if (attempt_) attempt_->check(now);
  if (now >= next_heartbeat_) {
    channel_->send("HB");
    next_heartbeat_ = after(now, job_.config.heartbeat_s);
  }
  if (phase_ != Phase::kEnding) {
    std::string why;
    if (channel_->closed()) why = channel_->why_closed();
    if (now > after(channel_->last_heard(), job_.config.peer_silence_s)) {
      why = "no message for " + seconds_text(job_.config.peer_silence_s);
    }
    if (!why.empty()) {
      job_.say(node0_ + " is gone: " + why + "; ending the job on this node");
      end_locally(kExitSetupFailed);
    }
  }
  if (phase_ != Phase::kEnding && job_.deadline && now >= *job_.deadline) {
    job_.say(job_.timeout_message() + "; ending the job");
    channel_->send("FAILED " + std::to_string(kExitTimeout) + " 0 " + job_.timeout_message());
    end_locally(kExitTimeout);
  }
  step();
}

void Follower::on_message(const std::string& line) {
  std::vector<std::string> f = fields(line, 1);
  if (f[0] == "HB") return;
  if (f[0] == "SAY") {
    job_.say(f[1]);
  } else if (f[0] == "START") {
    f = fields(line, 2);
    int restart = 0, port = 0;
    if (phase_ != Phase::kWaiting || !parse_int(f[1], &restart) || !parse_int(f[2], &port)) {
      return;
    }
    attempt_ = std::make_unique<Attempt>(job_.options, job_.config, job_.out, job_.err, port,
                                         restart);
    attempt_->start();
    reported_ = false;
    phase_ = Phase::kRunning;
  } else if (f[0] == "STOP") {
    if (attempt_ && !attempt_->done()) attempt_->stop("");
    if (phase_ == Phase::kRunning) phase_ = Phase::kStopped;
  } else if (f[0] == "END") {
    int code = kExitSetupFailed;
    parse_int(f[1], &code);
    if (phase_ != Phase::kEnding) end_locally(code);
  } else {
    job_.say(node0_ + " sent an unknown message: " + line.substr(0, 80));
  }
}

void Follower::on_interrupt(int signo) {
  if (attempt_ && !attempt_->done()) attempt_->on_signal(signo);
  if (interrupted_) return;
  interrupted_ = true;
  if (phase_ == Phase::kEnding) return;
  channel_->send("FAILED " + std::to_string(128 + signo) + " 0 received " + signal_name(signo));
  end_locally(128 + signo);
}

void Follower::end_locally(int code) {
  if (attempt_ && !attempt_->done()) attempt_->stop("");
  end_code_ = code;
  phase_ = Phase::kEnding;
}

void Follower::step() {
  switch (phase_) {
    case Phase::kWaiting:
      return;
    case Phase::kRunning:
      if (reported_) return;
      if (attempt_->failed()) {
        channel_->send("FAILED " + std::to_string(attempt_->exit_code(kExitSetupFailed)) + " 1 " +
                       attempt_->failure());
        reported_ = true;
      } else if (attempt_->setup_failed()) {
        channel_->send("FAILED " + std::to_string(kExitSetupFailed) + " 0 could not start its " +
                       "ranks");
        reported_ = true;
      } else if (attempt_->done()) {
        channel_->send("DONE");
        reported_ = true;
      }
      return;
    case Phase::kStopped:
      if (!attempt_->done()) return;
      attempt_->finish();
      attempt_.reset();
      channel_->send("READY");
      phase_ = Phase::kWaiting;
      return;
    case Phase::kEnding:
      finished_ = ranks_ended(attempt_.get(), interrupted_, &end_code_);
      return;
  }
}

}  // namespace

int run_agent(JobContext& job) {
  if (job.options.node_rank == 0) return Coordinator(job).run();
  return Follower(job).run();
}

}  // namespace hp::launcher
