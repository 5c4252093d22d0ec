"""`stepscope dashboard`: the dashboard over a trace file, a live collector, or none."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="the dashboard: a trace file, a live collector, or none")
    # The dashboard sits above the engine: its module (light: no Panel until it runs) is
    # imported here, in the command line only.
    from stepscope.viz import dashboard

    dashboard.add_arguments(p)
    p.set_defaults(func=dashboard.run)
