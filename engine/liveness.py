"""Liveness: every heartbeat, poll and timeout by which one stepscope process notices that another
is gone, in one place, with the relations between them asserted at import.

Start-up timeouts (model loading, the handshakes) stay with the code that starts things; shutdown
graces stay with the code that stops them. What is here runs for as long as the engine serves.

Who sends (or is polled), who watches, at what interval and timeout, and what happens then:

sender -> watcher                     interval; timeout                  when it runs out
------------------------------------  ---------------------------------  ------------------------
a parent -> each child it started     PARENT_WATCH_POLL_S (pid poll,     the child ends itself
  (`traces.process.watch_parent`)       kept in traces: a lower layer)     as on SIGTERM
API servers, headless engine cores    LAUNCHER_POLL_S (exit codes)       the deployment stops
  -> the launcher                                                          with an error
engine cores, DP coordinator -> the   ENGINE_PROCESS_POLL_S (pids or     EngineDeadError, naming
  API server, `SyncMPClient`, the       exit codes)                        the rank
  start-up handshake
local workers -> the executor         EXECUTOR_POLL_S in a step,         the executor fails, and
                                        IDLE_HEALTH_CHECK_S when idle      the engine core with it
                                        (process sentinels)
headless TP node (`run_worker_node`)  WORKER_NODE_HEARTBEAT_S;           the executor fails: "no
  -> node 0's executor                  WORKER_NODE_TIMEOUT_S              heartbeat" from node N
engine core (output thread) -> DP     DP_RANK_REPORT_S (`RankLoad`),     the rank is published as
  coordinator                           DP_RANK_CHECK_S; DP_RANK_TIMEOUT_S lost: API servers fail
DP coordinator -> engine cores on     COORDINATOR_HEARTBEAT_S (and       the core stops itself:
  other machines (`_watch_head`)        COORDINATOR_PUBLISH_S on change),  "no word from the head"
                                        HEAD_WATCH_POLL_S; HEAD_TIMEOUT_S

A timeout is at least three of the intervals it watches: one late heartbeat (a long step, a
loaded machine) must not read as a death.
"""

from __future__ import annotations

# Processes watched by their exit code or pid (on the same machine: no timeout needed).
LAUNCHER_POLL_S = 0.2
ENGINE_PROCESS_POLL_S = 0.1
EXECUTOR_POLL_S = 0.2
IDLE_HEALTH_CHECK_S = 0.5

# Tensor parallelism across machines: each headless node beats to node 0's executor.
WORKER_NODE_HEARTBEAT_S = 0.5
WORKER_NODE_TIMEOUT_S = 3.0

# Data parallelism: every engine core reports to the DP coordinator ...
DP_RANK_REPORT_S = 0.5
DP_RANK_CHECK_S = 0.5
DP_RANK_TIMEOUT_S = 3.0
# ... and the coordinator's publications are the head's heartbeat to engine cores elsewhere.
COORDINATOR_PUBLISH_S = 0.1
COORDINATOR_HEARTBEAT_S = 1.0
HEAD_WATCH_POLL_S = 0.25
HEAD_TIMEOUT_S = 5.0

# The executor reads a node's beats only when it looks: in a step or when idle.
assert WORKER_NODE_TIMEOUT_S >= 3 * WORKER_NODE_HEARTBEAT_S, "node timeout < 3 heartbeats"
assert 3 * max(EXECUTOR_POLL_S, IDLE_HEALTH_CHECK_S) <= WORKER_NODE_TIMEOUT_S, (
    "node timeout < 3 of the executor's looks at the heartbeats"
)
assert DP_RANK_TIMEOUT_S >= 3 * DP_RANK_REPORT_S, "DP rank timeout < 3 reports"
assert DP_RANK_TIMEOUT_S >= 3 * DP_RANK_CHECK_S, "DP rank timeout < 3 of the coordinator's checks"
assert COORDINATOR_PUBLISH_S < COORDINATOR_HEARTBEAT_S, "publishing on change slower than idle"
assert HEAD_TIMEOUT_S >= 3 * COORDINATOR_HEARTBEAT_S, "head timeout < 3 coordinator heartbeats"
assert HEAD_TIMEOUT_S >= 3 * HEAD_WATCH_POLL_S, "head timeout < 3 polls"
