"""Serving the dashboard: on its own (`serve_dashboard`; `stepscope dashboard`, or
`python -m stepscope.viz.dashboard`) or inside the trace collector process (`mount_on_collector`,
a collector extension).

Panel needs a Tornado server with websockets, which the collector's stdlib `ThreadingHTTPServer`
cannot host, so inside the collector the dashboard runs on its own port in a daemon thread and
queries the collector's `TraceStore` on cursors (DuckDB's one-writer rule is kept: the file has
one owner). The collector answers `GET /dashboard` with a redirect to it.

Every asset the page loads (Bokeh and Panel JS, Tabulator, CSS) comes from the Panel server:
resources are forced to "server" mode and the page uses no web fonts, so it works with no
network beyond 127.0.0.1.

Importing this module is cheap (the `stepscope` command line builds its options from it): Bokeh,
Panel and the trace sources are imported when a dashboard is served.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stepscope.traces.process import free_port

if TYPE_CHECKING:
    from stepscope.traces.backend.source import TraceSource

logger = logging.getLogger(__name__)

DASHBOARD_PORT_ENV = "STEPSCOPE_DASHBOARD_PORT"  # port for the dashboard inside the collector
DEFAULT_PORT = 5006
MOUNT_EXTENSION = "stepscope.viz.dashboard:mount_on_collector"


def _server_local_resources() -> None:
    """Bokeh/Panel JS and CSS from this server, never a CDN (beats BOKEH_RESOURCES=cdn)."""
    from bokeh.settings import settings as bokeh_settings

    bokeh_settings.resources.set_value("server")


def _origins(host: str, port: int) -> list[str]:
    origins = {f"{host}:{port}", f"127.0.0.1:{port}", f"localhost:{port}"}
    return sorted(origins)


def make_source(db: str | None = None, url: str | None = None) -> TraceSource | None:
    if db and url:
        raise ValueError("give the dashboard a trace file (db) or a collector URL (url), not both")
    from stepscope.traces.backend.source import CollectorSource, DuckDBSource

    if db:
        return DuckDBSource(db)
    if url:
        return CollectorSource(url)
    return None


def _serve(source: TraceSource | None, host: str, port: int, **kwargs: Any) -> Any:
    import panel as pn

    from stepscope.viz.app import build_app

    _server_local_resources()
    return pn.serve(
        {"/": lambda: build_app(source)},
        address=host,
        port=port,
        show=False,
        title="stepscope",
        websocket_origin=_origins(host, port),
        **kwargs,
    )


def serve_dashboard(
    db: str | None = None,
    url: str | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
) -> None:
    """Serve the dashboard until interrupted: a trace file (`db`, replayed read-only), a running
    collector (`url`, refreshed every second), or neither (the simulator only)."""
    source = make_source(db, url)
    logger.info(
        "stepscope dashboard on http://%s:%d/ (%s)",
        host,
        port,
        "no trace" if source is None else source.label,
    )
    _serve(source, host, port)


def _wait_listening(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"dashboard not listening on {host}:{port}") from None
            time.sleep(0.05)


def start_dashboard_thread(
    source: TraceSource | None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    timeout_s: float = 60.0,
) -> str:
    """Serve the dashboard from a daemon thread of this process; returns its URL once listening."""
    if port == 0:
        port = free_port(host)

    def run() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        try:
            _serve(source, host, port)
        except Exception:
            logger.exception("dashboard server on %s:%d failed", host, port)

    threading.Thread(target=run, name="stepscope-dashboard", daemon=True).start()
    _wait_listening(host, port, timeout_s)
    return f"http://{host}:{port}/"


def mount_on_collector(collector: Any) -> str:
    """Serve the live dashboard from the collector process, reading its store directly.

    A collector extension: `run_collector(..., extensions=[MOUNT_EXTENSION])`.

    The port is `$STEPSCOPE_DASHBOARD_PORT` (default 5006; 0 picks a free one), on the
    collector's host. Sets `collector.dashboard_url` and adds `GET /dashboard` (a redirect).
    """
    from stepscope.traces.backend.collector import HttpResponse
    from stepscope.traces.backend.source import StoreSource

    host = collector.server.server_address[0]
    port = int(os.environ.get(DASHBOARD_PORT_ENV, DEFAULT_PORT))
    url = start_dashboard_thread(StoreSource(collector.store), host, port)
    collector.dashboard_url = url
    collector.add_route(
        "GET", "/dashboard", lambda _: HttpResponse(302, b"", headers={"Location": url})
    )
    logger.info("dashboard on %s (live from the collector's store)", url)
    return url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `stepscope dashboard` and `python -m stepscope.viz.dashboard`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--db", help="a finished run's trace file (DuckDB), replayed read-only")
    group.add_argument("--url", help="a running collector's URL, refreshed every second")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)


def run(args: argparse.Namespace) -> None:
    """Serve the dashboard with the options of `add_arguments`, until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dashboard %(message)s")
    serve_dashboard(db=args.db, url=args.url, host=args.host, port=args.port)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="stepscope dashboard (Panel)")
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
