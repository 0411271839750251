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
from dataclasses import field, fields, make_dataclass
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


class _Overrides:
    """The operator's values; None = not given (then the model's, then the server's)."""

    def given(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) is not None}


class _Defaults:
    """What is in force for one deployment, each value with where it came from."""

    origin: dict[str, Origin]

    def describe(self) -> str:
        """One line for logs and `admin status`: 'temperature 0 (operator), top_p 1 (server)'."""
        return ", ".join(f"{name} {_num(getattr(self, name))} ({self.origin.get(name, Origin.SERVER)})"
                         for name in FIELDS)


# One field per parameter common/request_params.py declares `deployable`: a new one
# is an operator's flag, an admin argument and a field of DeploymentInfo with no edit here.
SamplingOverrides = make_dataclass(
    "SamplingOverrides",
    [(p.name, p.kind | None, field(default=None)) for p in request_params.deployable()],
    bases=(_Overrides,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": _Overrides.__doc__})
SamplingDefaults = make_dataclass(
    "SamplingDefaults",
    [*((p.name, p.kind, field(default=p.default)) for p in request_params.deployable()),
     ("origin", dict[str, Origin], field(default_factory=dict))],
    bases=(_Defaults,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": _Defaults.__doc__})
FIELDS = request_params.DEPLOYABLE


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
        value, kind = raw[name], request_params.BY_NAME[name].kind
        if kind is int and type(value) is float and value.is_integer():
            value = int(value)
        if kind is float and type(value) is int:
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
    typed = {k: request_params.BY_NAME[k].kind(v) for k, v in values.items()}
    return SamplingDefaults(**typed, origin=origin)
