"""The engine's options as a user writes them: `LLM(max_num_seqs=8)` and `--max-num-seqs 8`.

Both are generated from the fields of `EngineConfig`'s parts (engine/config.py), as vLLM's
`EngineArgs.add_cli_args` generates its flags: a field with a docstring is an option, its
docstring the flag's help, its type the flag's type (a `Literal`'s values its choices). A new
engine option is a new field there and the code that uses it; the flag, the keyword and the
validation follow.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from stepscope.engine.config import (
    FLAT_ALIASES,
    PARTS,
    EngineConfig,
    option_docs,
    option_type,
    unknown_name_message,
)


def engine_option_names() -> list[str]:
    """Every option a user may set, by its flat name, in the parts' order."""
    return [f.name for part in PARTS.values() for f in _user_fields(part)]


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword that is no engine option, naming the nearest one (vLLM's names that
    `EngineConfig.create` accepts for stepscope's, `FLAT_ALIASES`, are options too)."""
    known = [*engine_option_names(), *FLAT_ALIASES]
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
                _add_flag(group, part, f, defaults.get(f.name, f.default))


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The config a command line asks for: every engine flag's value, plus `overrides`."""
    flat = {n: getattr(args, n) for n in engine_option_names() if hasattr(args, n)}
    return EngineConfig.create(**{**flat, **overrides})


def parse_engine_option(name: str, text: str) -> Any:
    """`NAME=TEXT` (`stepscope trace replay --set`) as the value `--NAME TEXT` would give: an
    unknown name is refused with the nearest one, a value its type cannot take by the name."""
    fields = {f.name: f for part in PARTS.values() for f in _user_fields(part)}
    if name not in fields:
        raise ValueError(unknown_name_message(name, list(fields)))
    f = fields[name]
    base, choices = option_type(f.type)
    if text.lower() == "none" and _takes_none(f.type):
        return None
    if base is bool:
        if text.lower() in ("true", "on", "yes", "1"):
            return True
        if text.lower() in ("false", "off", "no", "0"):
            return False
        raise ValueError(f"{name} takes true or false, got {text!r}")
    try:
        value = base(text)
    except ValueError:
        raise ValueError(f"{name} takes {base.__name__} values, got {text!r}") from None
    if choices and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}, got {text!r}")
    return value


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The command line that asks for these engine options (flat names), every one spelled
    out, whatever the command's defaults: the inverse of `engine_config_from_args`."""
    flags: list[str] = []
    for part in PARTS.values():
        for f in _user_fields(part):
            if f.name not in options:
                continue
            value, flag = options[f.name], "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
            elif value is None:
                if f.default is not None and _takes_none(f.type):
                    flags += [flag, "none"]  # an option whose None means something
            else:
                flags += [flag, str(value)]
    return flags


def _user_fields(part: type[msgspec.Struct]) -> list[msgspec.structs.FieldInfo]:
    docs = option_docs(part)
    return [f for f in msgspec.structs.fields(part) if f.name in docs]


def _add_flag(group: Any, part: type, f: msgspec.structs.FieldInfo, default: Any) -> None:
    help = option_docs(part)[f.name]
    flag = "--" + f.name.replace("_", "-")
    base, choices = option_type(f.type)
    if base is bool:
        # `--NAME` and `--no-NAME`, whatever the default (vLLM's `--no-enable-prefix-caching`).
        group.add_argument(
            flag,
            dest=f.name,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help} Default: {'on' if default else 'off'}.",
        )
        return
    metavar = None
    if default is not None and _takes_none(f.type):
        # An option whose None means something (quantization=None: dequantize) is spelled
        # `--flag none` on the command line.
        if choices:
            metavar = "{" + ",".join((*choices, "none")) + "}"
            choices = (*choices, None)
        else:
            metavar = f"{{{base.__name__.upper()},none}}"
        base = _none_or(base)
    group.add_argument(
        flag,
        *part.aliases.get(f.name, ()),
        dest=f.name,
        type=base,
        default=default,
        choices=choices,
        metavar=metavar,
        help=help,
    )


def _takes_none(annotation: Any) -> bool:
    return type(None) in getattr(annotation, "__args__", ())


def _none_or(base: type):
    def convert(value: str):
        return None if value == "none" else base(value)

    convert.__name__ = base.__name__  # argparse names the type in its errors
    return convert
