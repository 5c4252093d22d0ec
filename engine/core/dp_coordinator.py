"""The data-parallel coordinator process (vLLM: `v1/engine/coordinator.py`, `DPCoordinator`).

With more than one DP rank, each engine core sends its queue (`RankLoad`: waiting and running
counts) here after every step that changed it, and at least every half second as a heartbeat.
The coordinator keeps the latest of each rank and publishes the whole list to every API server
about every 100 ms while it changes (and once a second regardless, so a late subscriber catches
up). The API servers route each new request to the least-loaded rank by these counts plus their
own in-flight requests. A rank that has reported once and then stays silent for DP_RANK_TIMEOUT_S
is published as lost: that is how an API server learns that an engine core on another machine
is gone (those on its own machine it watches by pid).

Only counts pass through here, never requests: a request goes from its API server straight to
the engine core it was routed to.

With tracing on, every publication is a `stepscope.dp_publish` span holding what was published
(per rank: waiting, running, lost, and the age of the rank's last report). They are the
`dp_loads` view: the balance between ranks exactly as the API servers saw it when routing.
"""

from __future__ import annotations

import signal
import sys
import time

import msgspec
import zmq

from stepscope.engine.liveness import (
    COORDINATOR_HEARTBEAT_S,
    COORDINATOR_PUBLISH_S,
    DP_RANK_CHECK_S,
    DP_RANK_TIMEOUT_S,
)
from stepscope.engine.messages import RankLoad
from stepscope.traces import names
from stepscope.traces.process import exit_once_on, ignore_terminal_signals, watch_parent
from stepscope.traces.setup import init_process_tracing
from stepscope.traces.spans import dp_publish_span


class CoordinatorArgs(msgspec.Struct):
    """What a new coordinator process reads from its stdin at start."""

    data_parallel_size: int
    stats_addr: str  # engine cores PUSH RankLoad here
    publish_addr: str  # API servers SUB here: [num_waiting, num_running, lost] per rank
    parent_pid: int
    collector_endpoint: str | None = None  # where its dp_publish spans go (None: not traced)
    otlp_endpoint: str | None = None
    # With ranks on other machines, the same publications over TCP: their engine cores watch
    # the head by them.
    head_addr: str | None = None


def encode_loads(loads: list[list[int]]) -> bytes:
    return msgspec.msgpack.encode(loads)


def decode_loads(data: bytes) -> list[list[int]]:
    return msgspec.msgpack.decode(data, type=list[list[int]])


def run_coordinator(args: CoordinatorArgs) -> None:
    ignore_terminal_signals()  # the API process decides on shutdown
    exit_once_on(signal.SIGTERM)
    watch_parent(args.parent_pid)
    # Spans leave every 200 ms, not every 2 s: a reader of a live trace sees balance promptly.
    init_process_tracing(
        names.SERVICE_DP_COORDINATOR,
        collector_endpoint=args.collector_endpoint,
        otlp_endpoint=args.otlp_endpoint,
        schedule_delay_ms=200,
    )
    ctx = zmq.Context()
    stats = ctx.socket(zmq.PULL)
    stats.bind(args.stats_addr)
    publish = ctx.socket(zmq.PUB)
    publish.bind(args.publish_addr)
    if args.head_addr is not None:
        publish.bind(args.head_addr)
    decoder = msgspec.msgpack.Decoder(RankLoad)
    loads = [[0, 0, 0] for _ in range(args.data_parallel_size)]
    seen: list[float | None] = [None] * args.data_parallel_size
    changed = True
    last_publish = 0.0
    try:
        while True:
            # Sleep until the next publish is due: soon after a change, else at the heartbeat.
            interval = COORDINATOR_PUBLISH_S if changed else COORDINATOR_HEARTBEAT_S
            wait_s = max(0.0, min(last_publish + interval - time.monotonic(), DP_RANK_CHECK_S))
            if stats.poll(int(wait_s * 1000) + 1):
                while True:  # drain: only the latest load of each rank matters
                    try:
                        load = decoder.decode(stats.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if 0 <= load.dp_rank < len(loads):
                        new = [load.num_waiting, load.num_running, 0]
                        changed |= loads[load.dp_rank] != new
                        loads[load.dp_rank] = new
                        seen[load.dp_rank] = time.monotonic()
            now = time.monotonic()
            for rank, at in enumerate(seen):
                if at is not None and now - at > DP_RANK_TIMEOUT_S and not loads[rank][2]:
                    loads[rank][2] = 1
                    changed = True
            due = now - last_publish >= (
                COORDINATOR_PUBLISH_S if changed else COORDINATOR_HEARTBEAT_S
            )
            if due:
                start_ns = time.time_ns()
                publish.send(encode_loads(loads))
                ages = [-1 if at is None else int((now - at) * 1000) for at in seen]
                dp_publish_span(loads, ages, start_ns, time.time_ns())
                last_publish, changed = now, False
    finally:
        ctx.destroy(linger=0)


def main() -> None:
    run_coordinator(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoordinatorArgs))


if __name__ == "__main__":
    main()
