"""`stepscope prepare`: build the cached weights of built-in models."""

from __future__ import annotations

import argparse

from stepscope.engine.models.loader import BUILTIN_MODELS, DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="build the cached weights of built-in models")
    p.add_argument("--model", action="append", choices=BUILTIN_MODELS)
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> None:
    from stepscope.engine.models.loader import resolve_model

    for model in args.model or [DEFAULT_MODEL]:
        print(f"{model}: {resolve_model(model)}")
