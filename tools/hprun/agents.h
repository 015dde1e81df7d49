// The agents' rendezvous: how the hprun of every node (--nnodes K > 1) agrees
// on each attempt. Node 0's hprun serves it on --rdzv-bind:--master-port
// (loopback unless asked); the others connect to --master-addr, retrying
// until --rdzv-timeout.
//
// The protocol, one line per message (at most kMaxLineBytes), words
// separated by one space; parsed strictly by agent_protocol.h. Every
// connection first passes the challenge (HELLO, CHALLENGE, AUTH: see
// agent_protocol.h); a connection that fails it is closed without a word.
//   node -> node 0   JOIN <node> <nnodes> <nproc> <max restarts>   after AUTH; ready
//                    READY                          its ranks are gone after a STOP
//                    DONE                           all its ranks exited 0
//                    FAILED <code> <restartable 0|1> <what happened>
//                    HB                             heartbeat, every heartbeat_s
//   node 0 -> node   START <restart count> <port>   start the ranks, MASTER_PORT=port
//                    SAY <line>                     print "hprun: <line>"
//                    STOP                           tear the attempt down, then READY
//                    END <code>                     tear down and exit with <code>
//                    HB
// Node 0 turns away a JOIN whose flags differ from its own (exit 2 there);
// only an agent that passed the challenge hears node 0's flags. Nothing
// here waits on a peer: rejections, goodbyes and reads are all bounded
// steps of the loop.
// Per attempt, node 0 waits until every node has joined (or is READY), picks
// a free port on its host for the ranks' rendezvous and sends START. The
// first failure anywhere (a rank, or a node gone: connection closed, or no
// message for peer_silence_s) decides: with restarts left node 0 sends the
// same "restart k/N: ... on node n at mm:ss" line to every node (SAY) and
// STOP, and starts the next attempt once all K are ready again, waiting at
// most --rdzv-timeout ("node 1 did not join restart 1 within 30 s" ends the
// job, exit 1); else it ends the job everywhere with the failure's code. The
// job succeeds when every node reported DONE. SIGINT/SIGTERM or --timeout on
// any node ends the job everywhere without a restart. A node whose node 0 is
// gone tears down and exits 1 naming node 0 and its address.
//
// All of it runs in one poll() loop per hprun, no threads.
#pragma once

#include "tools/hprun/job_context.h"

namespace hp::launcher {

// Runs the job as node options.node_rank's agent; returns hprun's exit code
// as run_job does.
int run_agent(JobContext& job);

}  // namespace hp::launcher
