"""The stepscope dashboard: scheduler simulator, one request's path, the engine's steps, and what
the recorded run would have done under other scheduler settings.

`build_app(source)` builds one session's page. `source` is a trace source (`DuckDBSource` for a
finished run's file, `CollectorSource` for a running collector, `StoreSource` inside the collector
process) or None: the simulator needs no trace, the other pages then say how to get one. Live
sources are re-read every second; a file is replayed step by step with a player.

Everything the browser loads comes from the Panel server itself (see `dashboard.serve_dashboard`):
no CDN, no web fonts.
"""

from __future__ import annotations

import html
import logging
import time

import panel as pn

from stepscope.traces.backend.source import CollectorSource, DuckDBSource, StoreSource, TraceSource
from stepscope.viz.engine_page import EnginePage
from stepscope.viz.path_page import RequestPathPage
from stepscope.viz.simulator_page import SimulatorPage
from stepscope.viz.whatif_page import WhatIfPage

__all__ = [
    "CollectorSource",
    "DuckDBSource",
    "EnginePage",
    "RequestPathPage",
    "SimulatorPage",
    "StoreSource",
    "WhatIfPage",
    "build_app",
]

logger = logging.getLogger(__name__)


# ---- the app ------------------------------------------------------------------------------------
def build_app(source: TraceSource | None = None) -> pn.template.BootstrapTemplate:
    """One session's dashboard over `source` (None: the simulator only)."""
    pn.extension("tabulator", design="bootstrap")
    simulator = SimulatorPage()
    path = RequestPathPage(source)
    # All pages render at load (dynamic=False): a tab that Panel renders later, when Python
    # switches to it (a request table row opening its path), gets CDN stylesheet URLs.
    tabs = pn.Tabs(dynamic=False, sizing_mode="stretch_width")

    def open_request(request_id: str) -> None:
        path.show(request_id)
        tabs.active = 1

    engine = EnginePage(source, open_request)
    # Read and fitted once per session; a live source reloads with the page's own button.
    whatif = WhatIfPage(source)
    tabs.extend(
        [
            ("Scheduler simulator", simulator.panel),
            ("Request path", path.panel),
            ("Engine", engine.panel),
            ("What if", whatif.panel),
        ]
    )
    label = "no trace loaded" if source is None else source.label
    status = pn.pane.HTML(
        f'<span id="source-label" style="color:white;font-size:14px">{html.escape(label)}</span>',
        align="center",
    )
    template = pn.template.BootstrapTemplate(
        title="stepscope",
        header=[status],
        main=[tabs],
        header_background="#1f3b57",
        main_max_width="1600px",
    )
    if source is not None and source.live:

        def refresh() -> None:
            try:
                engine.refresh()
                path.refresh_options()
                stamp = time.strftime("%H:%M:%S")
                status.object = (
                    f'<span id="source-label" style="color:white;font-size:14px">'
                    f"{html.escape(label)} · updated {stamp}</span>"
                )
            except Exception as error:  # keep the session alive across collector hiccups
                logger.warning("dashboard refresh failed: %s", error)
                status.object = (
                    f'<span id="source-label" style="color:#ffd6d6;font-size:14px">'
                    f"{html.escape(label)} · unreachable: {html.escape(str(error))[:80]}</span>"
                )

        if pn.state.curdoc is not None and pn.state.curdoc.session_context is not None:
            pn.state.add_periodic_callback(refresh, period=1000)
    return template
