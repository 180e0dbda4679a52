"""The config's errors and the checks shared by the schema and the loader: `ConfigError`,
`check`, the generic check of `Literal`-typed fields (`allowed`, `check_allowed`) and
`parse_resources`. Standard library only; imports nothing of the project."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


def check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def allowed(tp: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` type allows (None for any other type)."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def check_value(value: Any, choices: tuple[Any, ...], key: str) -> Any:
    """`value` when it is one of `choices`, else a ConfigError naming the key, the value and the
    allowed values."""
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ConfigError(f"{key}: {value!r} is not allowed (allowed: {', '.join(map(repr, choices))})")
    return value


def check_allowed(obj: Any, prefix: str) -> None:
    """Every ``Literal``-typed field of the dataclass `obj` (and every item of a ``list[Literal]``
    one) holds an allowed value, read from the annotations; the error names ``<prefix><field>``."""
    hints = typing.get_type_hints(type(obj))
    for name in (f.name for f in dataclasses.fields(obj)):
        tp, value = hints[name], getattr(obj, name)
        if (choices := allowed(tp)) is not None:
            check_value(value, choices, f"{prefix}{name}")
        elif typing.get_origin(tp) is list and (choices := allowed(typing.get_args(tp)[0])) is not None:
            for i, item in enumerate(value):
                check_value(item, choices, f"{prefix}{name}[{i}]")


def parse_resources(text: str, key: str) -> dict[str, float]:
    """"GPU=1,CPU=2" -> {"GPU": 1.0, "CPU": 2.0}; a bad entry is a ConfigError naming `key`."""
    out: dict[str, float] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        check(bool(sep) and bool(name.strip()) and value >= 0, key,
              f"expected NAME=amount entries like 'CPU=1' or 'GPU=1,CPU=2', got {item!r}")
        out[name.strip()] = value
    return out
