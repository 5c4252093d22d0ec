"""The engine's options as a user writes them: `LLM(max_num_seqs=8)` and `--max-num-seqs 8`.

Both are generated from the fields of `EngineConfig`'s parts (engine/config.py), as vLLM's
`EngineArgs.add_cli_args` generates its flags: a field with a description is an option, its
description the flag's help, its type the flag's type. A new engine option is a new field there
and the code that uses it; the flag, the keyword and the validation follow.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec

from stepscope.engine.config import PARTS, EngineConfig, field_meta, unknown_name_message


def engine_option_names() -> list[str]:
    """Every option a user may set, by its flat name, in the parts' order."""
    return [f.name for part in PARTS.values() for f in _user_fields(part)]


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword that is no engine option, naming the nearest one."""
    known = engine_option_names()
    for name in kwargs:
        if name not in known:
            raise ValueError(unknown_name_message(name, known))


def add_engine_args(
    parser: argparse.ArgumentParser,
    defaults: dict[str, Any] | None = None,
    only: tuple[str, ...] | None = None,
) -> None:
    """One `--flag` per engine option, in a group of its own. `defaults` overrides a field's
    default for this command (a server runs executor="mp"); `only` limits the flags to those
    names (a benchmark's budget)."""
    defaults = defaults or {}
    group = parser.add_argument_group("engine options (EngineConfig)")
    for part in PARTS.values():
        for f in _user_fields(part):
            if only is None or f.name in only:
                _add_flag(group, f, defaults.get(f.name, f.default))


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The config a command line asks for: every engine flag's value, plus `overrides`."""
    flat = {n: getattr(args, n) for n in engine_option_names() if hasattr(args, n)}
    return EngineConfig.create(**{**flat, **overrides})


def _user_fields(part: type[msgspec.Struct]) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(part) if field_meta(f.type) is not None]


def _add_flag(group: Any, f: msgspec.structs.FieldInfo, default: Any) -> None:
    meta = field_meta(f.type)
    assert meta is not None
    extra = meta.extra or {}
    flag = "--" + f.name.replace("_", "-")
    base = _base_type(f.type)
    if base is bool:
        # On by default: `--no-NAME` turns it off (vLLM's `--no-enable-prefix-caching`).
        if default:
            group.add_argument(
                "--no-" + flag[2:],
                dest=f.name,
                action="store_false",
                help=f"do not {meta.description}",
            )
        else:
            group.add_argument(flag, dest=f.name, action="store_true", help=meta.description)
        group.set_defaults(**{f.name: default})
        return
    group.add_argument(
        flag,
        *extra.get("aliases", ()),
        dest=f.name,
        type=base,
        default=default,
        choices=extra.get("choices"),
        help=meta.description,
    )


def _base_type(annotation: Any) -> type:
    """int for `Annotated[int | None, ...]`."""
    inner = typing.get_args(annotation)[0]
    if isinstance(inner, types.UnionType):
        inner = next(t for t in typing.get_args(inner) if t is not type(None))
    return inner
