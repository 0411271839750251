"""Typed settings: CLI > environment (`LOCKSTEP_<NAME>`) > defaults.

Each service declares one frozen dataclass of settings and builds it with
`load_settings(cls, cli)`; the README's configuration table lists every field.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "LOCKSTEP_"


class ConfigError(ValueError):
    pass


def _coerce(name: str, raw: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw == "":
            return None
        tp = args[0]
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is Path:
            return Path(raw).expanduser()
        if tp is str:
            return raw
        if typing.get_origin(tp) is tuple:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
    except ValueError:
        kind = getattr(tp, "__name__", str(tp))
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from None
    raise ConfigError(f"unsupported setting type for {name}: {tp}")


def load_settings(cls: type[T], cli: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> T:
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = ENV_PREFIX + f.name.upper()
        if key in env:
            values[f.name] = _coerce(f.name, env[key], hints[f.name])
    for k, v in (cli or {}).items():
        if v is not None:
            if k not in hints:
                raise ConfigError(f"unknown setting {k}")
            values[k] = v
    for f in dataclasses.fields(cls):
        if (f.init and f.name not in values and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise ConfigError(f"missing setting {f.name} (set {ENV_PREFIX}{f.name.upper()})")
    return cls(**values)


def default_home() -> Path:
    return Path(os.environ.get("LOCKSTEP_HOME", "~/.lockstep")).expanduser()
