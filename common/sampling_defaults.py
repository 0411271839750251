"""Sampling defaults: what a request is sampled with for each of temperature, top_p,
top_k, min_p and repetition_penalty that it does not name, per deployment.

Resolved once, by the supervisor at deploy time, field by field (as vLLM's
`--generation-config auto` and mlx_lm.server's `--temp`/`--top-p` flags do between them):

    the operator's value (`lockstep up --temperature`, `admin deploy --temperature`,
    POST /deployments `sampling`)  >  the model's generation_config.json  >  the server's
    (temperature 1, top_p 1, top_k 0 = off, min_p 0, repetition_penalty 1: OpenAI's)

A request's own value always wins over all three. The resolved record travels in
DeploymentInfo (`sampling`), so `admin status`, `/v1/models` and the console show what is
in force, and the gateway fills a request's omitted fields from it at admission: a
request keeps them if it ever moves to another deployment.

generation_config.json is read as vLLM reads it: only the values it states; `do_sample`
is not read (HF's greedy-unless-do_sample convention is transformers' own, and vLLM does
not apply it either). A value out of range there is left out, with a warning, never
served.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from common import request_params

log = logging.getLogger("lockstep.sampling_defaults")



class Origin(str, enum.Enum):
    """Where one default came from."""

    OPERATOR = "operator"  # a flag, an admin argument or a preset of `lockstep up`
    GENERATION_CONFIG = "generation_config"  # the model's generation_config.json
    SERVER = "server"  # nobody said: OpenAI's default (off)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class SamplingOverrides:
    """The operator's values; None = not given (then the model's, then the server's)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def given(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True, kw_only=True)
class SamplingDefaults:
    """What is in force for one deployment, each value with where it came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    origin: dict[str, Origin] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs and `admin status`: 'temperature 0 (operator), top_p 1 (server)'."""
        return ", ".join(f"{name} {_num(getattr(self, name))} ({self.origin.get(name, Origin.SERVER)})"
                         for name in FIELDS)


FIELDS = tuple(f.name for f in fields(SamplingOverrides))
if FIELDS != request_params.DEPLOYABLE or any(
        getattr(SamplingDefaults(), n) != request_params.BY_NAME[n].default for n in FIELDS):
    raise ImportError("SamplingOverrides/SamplingDefaults disagree with request_params.py")


def _num(v: float | int) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def problem(name: str, value: object) -> str | None:
    """Why `value` cannot be the default for `name` (the request's own ranges, as
    common/request_params.py declares them), or None."""
    return request_params.problem(name, value)


def check_overrides(o: SamplingOverrides) -> list[str]:
    """Every problem of the operator's values (empty: all usable)."""
    return [p for name, v in o.given().items() if (p := problem(name, v))]


def from_generation_config(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling values the model's generation_config.json states and we can serve."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable, its sampling values are not used: %s", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float | int] = {}
    for name in FIELDS:
        if name not in raw or raw[name] is None:
            continue
        value = raw[name]
        if name == "top_k" and type(value) is float and value.is_integer():
            value = int(value)
        if name != "top_k" and type(value) is int:
            value = float(value)
        if (why := problem(name, value)) is not None:
            log.warning("%s: %s=%r is not used: %s", path, name, raw[name], why)
            continue
        out[name] = value
    return out


def resolve(model_dir: str | Path, overrides: SamplingOverrides | None) -> SamplingDefaults:
    """Operator > generation_config.json > server, field by field."""
    values: dict[str, float | int] = {}
    origin: dict[str, Origin] = {name: Origin.SERVER for name in FIELDS}
    for name, v in from_generation_config(model_dir).items():
        values[name], origin[name] = v, Origin.GENERATION_CONFIG
    for name, v in (overrides.given() if overrides else {}).items():
        values[name], origin[name] = v, Origin.OPERATOR
    floats = {k: float(v) for k, v in values.items() if k != "top_k"}
    top_k = values.get("top_k")
    return SamplingDefaults(**floats, **({} if top_k is None else {"top_k": int(top_k)}),
                            origin=origin)
