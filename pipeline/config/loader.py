"""The generic loader: TOML file(s) and ``--section.key=value`` overrides onto the schema's
`Config`, every value checked against its field's type (`coerce`, the one coercer of the
project: `typed_fields` serves `serve run`'s arguments and the translate CLI too).

Precedence: command line > config file > the defaults (`pipeline.config.schema`). A
``Literal``-typed field takes only its allowed values; the error names the key, the value and
the allowed values.
"""

from __future__ import annotations

import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from .checks import ConfigError, allowed, check_value
from .migrations import MOVED_KEYS, moved_to_new_places
from .schema import Config


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and, for strings from the command line, parse) a value against a field's type.

    The one coercer of the project: config sections, `serve run` arguments and the translate
    CLI all go through it (`typed_fields`), so a key's errors read the same everywhere."""
    origin = typing.get_origin(tp)
    if (choices := allowed(tp)) is not None:
        return check_value(value, choices, key)
    if origin in (typing.Union, types.UnionType):  # e.g. int | list[int]: the first type that fits
        for option in typing.get_args(tp):
            try:
                return coerce(value, option, key)
            except ConfigError:
                pass
        names = " or ".join(getattr(o, "__name__", str(o)) if typing.get_origin(o) is None else str(o)
                            for o in typing.get_args(tp))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # from the command line: comma-separated
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    out = _scalar(value, tp)
    if out is _NOT_OF_TYPE:
        raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r}")
    return out


_NOT_OF_TYPE = object()


def _scalar(value: Any, tp: Any) -> Any:
    """`value` as the scalar type `tp` (None, bool, int, float or str; a string from the command line
    parsed), or `_NOT_OF_TYPE`."""
    if tp is type(None):  # `int | None`: None (a dict from `to_dict`), or "none" from the command line
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
    elif tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    return _NOT_OF_TYPE


def _apply(cfg: Config, values: dict[str, Any], origin: str) -> None:
    hints = typing.get_type_hints(Config)
    for section_name, section_values in values.items():
        for key in section_values if isinstance(section_values, dict) else ():
            if (new := MOVED_KEYS.get(f"{section_name}.{key}")) is not None:
                raise ConfigError(f"{section_name}.{key} is now {new} (in {origin})")
        if section_name not in hints:
            raise ConfigError(f"{section_name}: unknown config section in {origin} "
                              f"(known: {', '.join(hints)})")
        if not isinstance(section_values, dict):
            raise ConfigError(f"{section_name}: expected a [table] in {origin}")
        section = getattr(cfg, section_name)
        for key, value in typed_fields(type(section), section_values, origin, f"{section_name}.").items():
            setattr(section, key, value)


def typed_fields(cls: type, values: dict[str, Any], origin: str, prefix: str = "") -> dict[str, Any]:
    """`values` checked against the dataclass `cls`'s fields (`coerce`d by their type hints);
    an unknown key is a `ConfigError` naming it and the known ones."""
    field_types = typing.get_type_hints(cls)
    out = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in field_types:
            raise ConfigError(f"{full}: unknown config key in {origin} (known: {', '.join(field_types)})")
        out[key] = coerce(value, field_types[key], full)
    return out


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """``["--train.max_steps=10", ...]`` -> ``{"train": {"max_steps": "10"}}``."""
    out: dict[str, dict[str, str]] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"{arg}: overrides look like --section.key=value")
        dotted, value = body.split("=", 1)
        section, key = dotted.split(".", 1)
        out.setdefault(section, {})[key] = value
    return out


def load_config(path: str | Path | typing.Sequence[str | Path] | None = None,
                overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file(s) in order (a later file overrides the keys it names, e.g. a
    recipe then ``configs/cluster-overlay.toml``), then ``--section.key=value`` overrides; validated."""
    cfg = Config()
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"--config: no such file {p}")
        with p.open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{p}: not valid TOML ({e})") from e
        _apply(cfg, data, str(p))
    if overrides:
        _apply(cfg, parse_overrides(overrides), "the command line")
    _normalize(cfg)
    return cfg.validate()


def _normalize(cfg: Config) -> None:
    """One spelling per local mirror folder, so `../x` and `/abs/x` give the same cache key."""
    mirror = cfg.data.mirror
    if mirror and "://" not in mirror:
        cfg.data.mirror = str(Path(mirror).expanduser().resolve())


def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from ``to_dict()`` output (inside Ray workers; a run record written before
    a key moved reads with the key in its new place)."""
    cfg = Config()
    _apply(cfg, moved_to_new_places(data), "a config dict")
    return cfg.validate()
