"""Typed settings: CLI > environment (`LOCKSTEP_<NAME>`) > defaults, one parser.

Each service declares one frozen dataclass of settings and builds it with
`load_settings(cls, cli)`. A field's name is the setting's only name: its flag is
`--<name-with-dashes>`, its variable `LOCKSTEP_<NAME>`, and the rank's spec carries it
under the same name (common/rankspec.py). Ranges are declared on the field's type
(`Seconds`, `Port`, ... below) and checked here, once, by
pydantic, for every value whatever its source. tests/unit/test_settings_docs.py checks
README's configuration table against these classes.

Why not pydantic-settings: the settings must stay plain dataclasses (the rank's spec
embeds `RankSettings` and is decoded by common/schema.py, tests `dataclasses.replace`
them), the loader takes an explicit environment mapping (a rank overlays the variables
its launcher gave it, tests pass dicts), and the parsing rules are these forty lines;
pydantic (already a dependency) does the validation.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Gt, Le, Lt

T = TypeVar("T")
ENV_PREFIX = "LOCKSTEP_"

# Ranges, declared on a field's type (`timeout: Seconds = 10.0`) as annotated-types
# constraints, which pydantic enforces; pydantic itself is imported only to validate.
# NaN fails every comparison and `Lt(inf)` refuses infinity: seconds are finite.
Seconds = Annotated[float, Ge(0), Lt(math.inf)]  # 0 usually means "off"
PositiveSeconds = Annotated[float, Gt(0), Lt(math.inf)]
Port = Annotated[int, Ge(0), Le(65535)]  # 0 = any free port
Count = Annotated[int, Ge(0)]  # 0 usually means "the default bound"
AtLeastOne = Annotated[int, Ge(1)]
AutoCount = Annotated[int, Ge(-1)]  # -1 = auto (resolved by whoever owns the setting)
StallRatio = Annotated[float, Ge(0), Lt(math.inf)]  # 0 = off; else >= 1 in practice
Probability = Annotated[float, Ge(0), Le(1)]


class ConfigError(ValueError):
    pass


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _coerce(name: str, raw: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw == "":
            return None
        tp = args[0]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a closed set: name its values
        try:
            return tp(raw.strip())
        except ValueError:
            raise ConfigError(f"{env_name(name)}={raw!r} is not one of "
                              f"{', '.join(m.value for m in tp)}") from None
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
        raise ConfigError(f"{env_name(name)}={raw!r} is not a valid {kind}") from None
    raise ConfigError(f"unsupported setting type for {name}: {tp}")


@functools.cache
def _adapter(cls: type) -> Any:
    import pydantic  # ~0.1 s: only processes that load settings pay for it

    return pydantic.TypeAdapter(cls)


def validate(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls(**values)` with every declared range checked; ConfigError names the variable."""
    import pydantic

    try:
        return _adapter(cls).validate_python(dict(values))
    except pydantic.ValidationError as exc:
        parts = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "?"
            shown = values.get(name, err.get("input"))
            flag = "--" + name.replace("_", "-")
            parts.append(f"{name}={shown!r} ({flag} / {env_name(name)}): {err['msg'].lower()}")
        raise ConfigError("; ".join(parts)) from None


def check(settings: T) -> T:
    """The ranges of an instance built directly (a decoded spec, `dataclasses.replace`)."""
    return validate(type(settings), {f.name: getattr(settings, f.name)
                                     for f in dataclasses.fields(settings) if f.init})


def load_settings(cls: type[T], cli: dict[str, Any] | None = None,
                  env: Mapping[str, str] | None = None, *, base: T | None = None,
                  only: Iterable[str] | None = None, blank_is_unset: bool = False) -> T:
    """CLI > `env` (os.environ if None) > `base`'s values (else the defaults). `only`:
    the fields the environment may set (a rank's overlay over its spec);
    `blank_is_unset`: an empty variable counts as unset."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    allowed = {f.name for f in fields} if only is None else set(only)
    values: dict[str, Any] = {} if base is None else {f.name: getattr(base, f.name)
                                                      for f in fields}
    for f in fields:
        key = env_name(f.name)
        if f.name in allowed and key in env and not (blank_is_unset and not env[key].strip()):
            values[f.name] = _coerce(f.name, env[key], hints[f.name])
    for k, v in (cli or {}).items():
        if v is not None:
            if k not in hints:
                raise ConfigError(f"unknown setting {k}")
            values[k] = v
    for f in fields:
        if (f.name not in values and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise ConfigError(f"missing setting {f.name} (set {env_name(f.name)})")
    return validate(cls, values)

