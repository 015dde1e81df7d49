#include "tools/hprun/agents.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tools/hprun/agent_protocol.h"
#include "tools/hprun/exit_status.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/line_channel.h"
#include "tools/hprun/sha256.h"

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

std::string node_name(int node) { return "node " + std::to_string(node); }

// Our own text for a protocol line: one line, of bounded length (a rank's
// failure text can be anything).
std::string one_line(const std::string& text) {
  std::string line = text.substr(0, 1000);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return line;
}

// Refused connections are named on node 0's stderr up to this many times;
// a flood of them must not flood the terminal too.
constexpr int kRefusalsNamed = 20;

// Node 0: serves the agents' rendezvous and decides about every attempt.
class Coordinator {
 public:
  Coordinator(JobContext& job, std::string secret)
      : job_(job), secret_(std::move(secret)), peers_(static_cast<std::size_t>(job.options.nnodes)) {}
  int run();

 private:
  struct Peer {
    std::unique_ptr<LineChannel> channel;
    std::string address;
    bool ready = false;  // joined, no ranks running: can start an attempt
    bool done = false;   // every rank of this attempt exited 0
  };
  // A connection before its JOIN: it has kHandshakeLimitS to pass the
  // challenge (agent_protocol.h) and join.
  struct Pending {
    std::unique_ptr<LineChannel> channel;
    std::string address;
    Node0Gate gate;
    Clock::time_point deadline;
  };
  // A turned-away agent that passed the challenge, reading why (SAY, END);
  // closed by the loop once sent or after a second, never waited for.
  struct Leaving {
    std::unique_ptr<LineChannel> channel;
    Clock::time_point deadline;
  };
  enum class Phase { kJoining, kRunning, kEnding };

  void poll_round();
  void accept_pending(Clock::time_point now);
  void on_pending_line(Pending& pending, const std::string& line);
  void refuse(const std::string& address, const std::string& why);
  void on_join(std::unique_ptr<LineChannel> channel, const std::string& address, const Join& j);
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
  const std::string secret_;
  int listen_fd_ = -1;
  std::vector<Peer> peers_;  // by node rank; [0] is this node and unused
  std::vector<Pending> pending_;  // at most kMaxPendingAgents
  std::vector<Leaving> leaving_;  // at most kMaxPendingAgents
  int refusals_ = 0;
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
    listen_fd_ = listen_on_port(job_.options.rdzv_bind, job_.options.master_port);
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
  for (Leaving& leaving : leaving_) channels.push_back(leaving.channel.get());
  // Strangers are not owed a goodbye.
  pending_.clear();
  LineChannel::close_all(channels, 1.0);
  if (refusals_ > kRefusalsNamed) {
    job_.say(std::to_string(refusals_) + " connections were turned away in all");
  }
  return end_code_;
}

void Coordinator::poll_round() {
  std::vector<pollfd> fds{{job_.signals.fd(), POLLIN, 0}, {listen_fd_, POLLIN, 0}};
  // Every range of fds is fixed here, before anything is accepted or joined;
  // connections accepted in this round are polled from the next one on.
  const std::size_t pending_at = fds.size();
  for (Pending& pending : pending_) fds.push_back({pending.channel->fd(), pending.channel->events(), 0});
  const std::size_t leaving_at = fds.size();
  for (Leaving& leaving : leaving_) fds.push_back({leaving.channel->fd(), leaving.channel->events(), 0});
  const std::size_t peers_at = fds.size();
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
  for (Pending& pending : pending_) earliest(&next, pending.deadline);
  for (Leaving& leaving : leaving_) earliest(&next, leaving.deadline);
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
  // Nothing below waits: a refused connection is closed at once, a refused
  // agent is left to the next rounds (leaving_).
  std::vector<Leaving> polled_leaving = std::move(leaving_);
  leaving_.clear();
  for (std::size_t i = 0; i < polled_leaving.size(); ++i) {
    Leaving& leaving = polled_leaving[i];
    leaving.channel->on_poll(fds[leaving_at + i].revents);
    if (!leaving.channel->closed() && now < leaving.deadline) leaving_.push_back(std::move(leaving));
  }
  std::vector<Pending> polled_pending = std::move(pending_);
  pending_.clear();
  for (std::size_t i = 0; i < polled_pending.size(); ++i) {
    Pending& pending = polled_pending[i];
    pending.channel->on_poll(fds[pending_at + i].revents);
    std::string line;
    while (pending.channel && pending.channel->next_line(&line)) on_pending_line(pending, line);
    if (!pending.channel) continue;  // joined or refused
    if (pending.channel->closed()) {
      refuse(pending.address, pending.channel->why_closed() + " before joining");
    } else if (now >= pending.deadline) {
      refuse(pending.address, "did not pass the challenge and join within " +
                                  seconds_text(kHandshakeLimitS));
    } else {
      pending_.push_back(std::move(pending));
    }
  }
  if (fds[1].revents != 0) accept_pending(now);
  for (std::size_t i = 0; i < polled_peers.size(); ++i) {
    const int n = polled_peers[i];
    const short revents = fds[peers_at + i].revents;
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

void Coordinator::accept_pending(Clock::time_point now) {
  std::string address;
  // One listen backlog's worth per round at most, so that a flood of
  // connections cannot keep the loop here.
  for (int accepted = 0, fd; accepted < 64 && (fd = accept_connection(listen_fd_, &address)) >= 0;
       ++accepted) {
    auto channel = std::make_unique<LineChannel>(fd);
    if (pending_.size() >= kMaxPendingAgents) {
      refuse(address, "found " + std::to_string(kMaxPendingAgents) +
                          " connections already waiting to join");
      continue;  // closed here
    }
    try {
      pending_.push_back({std::move(channel), address,
                          Node0Gate(secret_, random_bytes(kNonceBytes)),
                          after(now, kHandshakeLimitS)});
    } catch (const std::exception& e) {
      refuse(address, e.what());
    }
  }
}

void Coordinator::on_pending_line(Pending& pending, const std::string& line) {
  GateStep step = pending.gate.on_line(line);
  if (step.status == GateStep::Status::kRefused) {
    refuse(pending.address, step.refusal);
    pending.channel.reset();
  } else if (step.status == GateStep::Status::kPassed) {
    on_join(std::move(pending.channel), pending.address, step.join);
  } else if (!step.reply.empty()) {
    pending.channel->send(step.reply);
  }
}

void Coordinator::refuse(const std::string& address, const std::string& why) {
  // The stranger is told nothing: the connection just closes.
  ++refusals_;
  if (refusals_ <= kRefusalsNamed) {
    job_.say("turned away a connection from " + address + ": it " + why +
             (refusals_ == kRefusalsNamed ? " (further ones are only counted)" : ""));
  }
}

void Coordinator::on_join(std::unique_ptr<LineChannel> channel, const std::string& address,
                          const Join& j) {
  const int node = j.node;
  std::string problem;
  const LaunchOptions& o = job_.options;
  // Only an agent that proved it holds the job's secret gets here, so it
  // may hear node 0's flags.
  if (j.nnodes != o.nnodes || j.nproc != o.nproc_per_node || j.max_restarts != o.max_restarts) {
    // The ranks' world (and TORCHELASTIC_MAX_RESTARTS) must be the same on every node.
    auto flags = [](int k, int n, int r) {
      return "--nnodes " + std::to_string(k) + " -n " + std::to_string(n) + " --max-restarts " +
             std::to_string(r);
    };
    problem = node_name(node) + " (" + address + ") was started with " +
              flags(j.nnodes, j.nproc, j.max_restarts) + ", node 0 with " +
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
    channel->close_when_sent();
    if (leaving_.size() < kMaxPendingAgents) {
      leaving_.push_back({std::move(channel), after(Clock::now(), 1.0)});
    }
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
  Parsed<NodeMessage> parsed = parse_node_message(line);
  if (!parsed.value) {
    job_.say(node_name(node) + " sent " + parsed.refusal + "; ignoring it");
    return;
  }
  const NodeMessage& m = *parsed.value;
  switch (m.kind) {
    case NodeMessage::Kind::kHeartbeat:
      return;
    case NodeMessage::Kind::kReady:
      peer.ready = true;
      return;
    case NodeMessage::Kind::kDone:
      peer.done = true;
      return;
    case NodeMessage::Kind::kFailed:
      on_failure(printable(m.what) + " on " + node_name(node), m.code, m.restartable,
                 Clock::now());
      return;
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
    if (peer.channel) peer.channel->send(one_line(line));
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
  Follower(JobContext& job, std::string secret)
      : job_(job),
        secret_(std::move(secret)),
        node0_("node 0 (" + job.options.master_addr + ":" +
               std::to_string(job.options.master_port) + ")") {}
  int run();

 private:
  enum class Phase { kWaiting, kRunning, kStopped, kEnding };

  bool connect();
  void poll_round();
  void on_line(const std::string& line);
  void on_message(const std::string& line);
  void report(const std::string& line);
  void on_interrupt(int signo);
  void step();
  void end_locally(int code);

  JobContext& job_;
  const std::string secret_;
  std::string node0_;
  std::unique_ptr<LineChannel> channel_;
  // Until node 0 passed the challenge nothing it sends is acted on, and this
  // node sends nothing but the challenge's lines.
  std::optional<FollowerGate> gate_;
  bool authenticated_ = false;
  bool distrusted_ = false;  // node 0 failed the challenge: its lines are dropped
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
          try {
            gate_.emplace(secret_, random_bytes(kNonceBytes));
          } catch (const std::exception& e) {
            job_.say(e.what());
            end_code_ = kExitSetupFailed;
            return false;
          }
          channel_->send(gate_->hello());
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
  for (std::string line; channel_->next_line(&line);) on_line(line);
  if (attempt_) attempt_->check(now);
  if (now >= next_heartbeat_) {
    report("HB");
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
    report("FAILED " + std::to_string(kExitTimeout) + " 0 " + job_.timeout_message());
    end_locally(kExitTimeout);
  }
  step();
}

void Follower::report(const std::string& line) {
  if (authenticated_) channel_->send(one_line(line));
}

void Follower::on_line(const std::string& line) {
  if (distrusted_) return;
  if (authenticated_) {
    on_message(line);
    return;
  }
  GateStep step = gate_->on_line(line);
  if (step.status != GateStep::Status::kPassed) {
    distrusted_ = true;
    job_.say("not joining " + node0_ + ": " + step.refusal);
    if (phase_ != Phase::kEnding) end_locally(kExitSetupFailed);
    return;
  }
  const LaunchOptions& o = job_.options;
  channel_->send(step.reply);
  channel_->send("JOIN " + std::to_string(o.node_rank) + " " + std::to_string(o.nnodes) + " " +
                 std::to_string(o.nproc_per_node) + " " + std::to_string(o.max_restarts));
  authenticated_ = true;
}

void Follower::on_message(const std::string& line) {
  Parsed<Node0Message> parsed = parse_node0_message(line);
  if (!parsed.value) {
    job_.say(node0_ + " sent " + parsed.refusal + "; ignoring it");
    return;
  }
  const Node0Message& m = *parsed.value;
  switch (m.kind) {
    case Node0Message::Kind::kHeartbeat:
      return;
    case Node0Message::Kind::kSay:
      job_.say(printable(m.text, kMaxLineBytes));
      return;
    case Node0Message::Kind::kStart:
      if (phase_ != Phase::kWaiting) return;
      attempt_ = std::make_unique<Attempt>(job_.options, job_.config, job_.out, job_.err, m.port,
                                           m.restart_count);
      attempt_->start();
      reported_ = false;
      phase_ = Phase::kRunning;
      return;
    case Node0Message::Kind::kStop:
      if (attempt_ && !attempt_->done()) attempt_->stop("");
      if (phase_ == Phase::kRunning) phase_ = Phase::kStopped;
      return;
    case Node0Message::Kind::kEnd:
      if (phase_ != Phase::kEnding) end_locally(m.code);
      return;
  }
}

void Follower::on_interrupt(int signo) {
  if (attempt_ && !attempt_->done()) attempt_->on_signal(signo);
  if (interrupted_) return;
  interrupted_ = true;
  if (phase_ == Phase::kEnding) return;
  report("FAILED " + std::to_string(128 + signo) + " 0 received " + signal_name(signo));
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
        report("FAILED " + std::to_string(attempt_->exit_code(kExitSetupFailed)) + " 1 " +
               attempt_->failure());
        reported_ = true;
      } else if (attempt_->setup_failed()) {
        report("FAILED " + std::to_string(kExitSetupFailed) + " 0 could not start its ranks");
        reported_ = true;
      } else if (attempt_->done()) {
        report("DONE");
        reported_ = true;
      }
      return;
    case Phase::kStopped:
      if (!attempt_->done()) return;
      attempt_->finish();
      attempt_.reset();
      report("READY");
      phase_ = Phase::kWaiting;
      return;
    case Phase::kEnding:
      finished_ = ranks_ended(attempt_.get(), interrupted_, &end_code_);
      return;
  }
}

}  // namespace

int run_agent(JobContext& job) {
  std::string secret;
  try {
    secret = load_rdzv_secret(job.options.rdzv_secret_file, std::getenv(kSecretEnv));
  } catch (const std::invalid_argument& e) {
    job.say(e.what());
    return kExitUsage;
  }
  if (job.options.node_rank == 0) return Coordinator(job, std::move(secret)).run();
  return Follower(job, std::move(secret)).run();
}

}  // namespace hp::launcher
