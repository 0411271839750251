"""Every request parameter that shapes how tokens are chosen, declared once.

A `Param` says what the parameter is (type, the value that means "off", its range, per
API where the APIs differ), where it may come from (a deployment default: `deployable`)
and how it is spelled and documented. The layers read it rather than restate it:

- the gateway's request schemas (services/gateway/core/sampling_params.py builds each API's
  pydantic fields from `params_in(api)`: chat, completions, Responses and Messages);
- the translation of Responses and Messages into the internal request (`given`);
- the field-support tables and the docs' field tables (`note`);
- the deployment defaults (common/sampling_defaults.py: `DEPLOYABLE`, `problem`);
- rank 0's check of a GENERATE's sampling record (services/rank/sampling.py: `problem`,
  over the wire range).

The limits shared across processes are defined here and nowhere else (the gateway's
schemas and rank 0's check read the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "chat", "completions", "responses", "messages"
APIS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
OPENAI_CHAT = (CHAT, COMPLETIONS)  # where OpenAI's own spelling of a field lives

MAX_TOP_K = 1 << 24  # above any vocabulary (a larger k keeps every token: the same as off)
MAX_CONTEXT_SIZE = 1 << 20  # repetition_context_size's bound
BIAS_LIMIT = 100.0  # |logit_bias| per token (OpenAI's)
MAX_LOGIT_BIAS = 1024  # logit_bias entries (the wire's bound, common/messages/base.py)
MAX_TOP_LOGPROBS = 20  # chat's bound (OpenAI)
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's)
MAX_PRIORITY = 1 << 20  # |priority|
SEED_MOD = 1 << 63  # the wire's seeds are in [0, SEED_MOD): a client's is taken modulo it


@dataclass(frozen=True)
class Bounds:
    """A closed or half-open interval; None: unbounded on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def text(self) -> str:
        """'[0, 2]', '(0, 1]', '> 0', '>= 1'."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return (f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                f"{')' if self.hi_open else ']'}")

    def pydantic(self) -> dict[str, float]:
        """The keyword arguments of pydantic's `Field` for these bounds."""
        out: dict[str, float] = {}
        if self.lo is not None:
            out["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            out["lt" if self.hi_open else "le"] = self.hi
        return out


def _num(v: float | None) -> str:
    if v is None:
        return ""
    if isinstance(v, int) and abs(v) >= 1 << 16 and (abs(v) & (abs(v) - 1)) == 0:
        return f"{'-' if v < 0 else ''}2^{abs(v).bit_length() - 1}"
    return f"{v:g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Param:
    """One request parameter. `off` is the wire's value when neither the request nor the
    deployment names it (None: decided at admission, as the seed is)."""

    name: str
    # dict: token id (a string) → a number; bool: a switch (its bounds unused)
    kind: type[int] | type[float] | type[dict] | type[bool]
    off: float | None
    bounds: Bounds
    doc: str  # what it does, for the field tables (the range is added from `bounds`)
    deployable: bool = False  # a deployment may default it (flags, generation_config.json)
    server_default: float | None = None  # deployable: what nobody saying means (else `off`)
    per_api: Mapping[str, Bounds] = field(default_factory=dict)  # where an API differs
    apis: tuple[str, ...] = APIS  # the APIs that take it (all, unless said why not)
    native: tuple[str, ...] = ()  # APIs whose own spec has it; elsewhere it is our extension

    def bounds_in(self, api: str) -> Bounds:
        return self.per_api.get(api, self.bounds)

    def note(self, api: str) -> str:
        """The field table's line for `api`: its range, then what it does."""
        if self.kind is bool:
            return f"true or false; {self.doc}"
        return f"{self.bounds_in(api).text()}; {self.doc}"

    def extension_in(self, api: str) -> bool:
        return api not in self.native

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "LOCKSTEP_" + self.name.upper()

    @property
    def default(self) -> float:
        """A deployment's default when nobody said (deployable parameters)."""
        value = self.server_default if self.server_default is not None else self.off
        assert value is not None, self.name
        return value


PARAMS: tuple[Param, ...] = (
    Param("temperature", float, 0.0, Bounds(0.0, 2.0),
          "0 is greedy; omitted: the deployment's default (1 unless set)",
          deployable=True, server_default=1.0, per_api={MESSAGES: Bounds(0.0, 1.0)},
          native=APIS),
    Param("top_p", float, 1.0, Bounds(0.0, 1.0, lo_open=True),
          "nucleus sampling; omitted: the deployment's default", deployable=True,
          native=APIS),
    Param("top_k", int, 0, Bounds(-1, MAX_TOP_K),
          "0 = off (so is -1 where the range takes it); applied on every rank; "
          "omitted: the deployment's default",
          deployable=True, per_api={MESSAGES: Bounds(0, MAX_TOP_K)}, native=(MESSAGES,)),
    Param("min_p", float, 0.0, Bounds(0.0, 1.0),
          "applied on every rank; omitted: the deployment's default", deployable=True),
    Param("presence_penalty", float, 0.0, Bounds(-PENALTY_LIMIT, PENALTY_LIMIT),
          "applied on every rank", native=OPENAI_CHAT),
    Param("frequency_penalty", float, 0.0, Bounds(-PENALTY_LIMIT, PENALTY_LIMIT),
          "applied on every rank", native=OPENAI_CHAT),
    Param("repetition_penalty", float, 1.0, Bounds(0.0, lo_open=True),
          "1 = off; applied on every rank; omitted: the deployment's default",
          deployable=True),
    Param("repetition_context_size", int, 20, Bounds(1, MAX_CONTEXT_SIZE),
          "tokens `repetition_penalty` looks back over"),
    Param("xtc_probability", float, 0.0, Bounds(0.0, 1.0),
          "XTC (mlx-lm's \"exclude top choices\"): the chance, per sampled token, that every "
          "token above `xtc_threshold` but the least likely of them is excluded; the coin is "
          "drawn from the seed and the token's index; omitted: the deployment's default",
          deployable=True),
    Param("xtc_threshold", float, 0.1, Bounds(0.0, 0.5),
          "XTC: the probability a token needs to count as a top choice; omitted: the "
          "deployment's default", deployable=True),
    Param("logit_bias", dict, None, Bounds(-BIAS_LIMIT, BIAS_LIMIT),
          "per token: token id (a decimal string) → a bias added to its logit, at most "
          f"{MAX_LOGIT_BIAS} entries, checked against the model's vocabulary; applied on "
          "every rank", native=OPENAI_CHAT),
    # Scheduling, not sampling: it travels in GENERATE beside the sampling record.
    Param("priority", int, None, Bounds(-MAX_PRIORITY, MAX_PRIORITY),
          "lower runs first (vLLM's extension): rank 0's queue orders by priority, then "
          "arrival, and a waiting request preempts a running one of a larger value when "
          "no slot or KV is free; omitted: the `x-lockstep-priority` header, else 0"),
    # Speed, not choice: a request's tokens are the same either way (services/rank/spec_step.py).
    Param("speculative", bool, True, Bounds(),
          "false: this request's decode steps verify no drafts even where the deployment "
          "speculates (`--speculative`); its tokens and logprobs are the same either way"),
    # What a client may send; the wire keeps seed % 2**63.
    Param("seed", int, None, Bounds(-(2**63), 2**64, hi_open=True),
          "same seed → same tokens; omitted: drawn at admission", native=OPENAI_CHAT),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
DEPLOYABLE: tuple[str, ...] = tuple(p.name for p in PARAMS if p.deployable)
WIRE: tuple[Param, ...] = tuple(p for p in PARAMS if p.off is not None)  # in every GENERATE


def deployable() -> tuple[Param, ...]:
    return tuple(p for p in PARAMS if p.deployable)


def params_in(api: str) -> tuple[Param, ...]:
    return tuple(p for p in PARAMS if api in p.apis)


def problem(name: str, value: object, api: str | None = None) -> str | None:
    """Why `value` is not a valid `name` (in `api`'s range; None: the declared range,
    the one rank 0 and the deployment defaults check), or None."""
    p = BY_NAME[name]
    bounds = p.bounds if api is None else p.bounds_in(api)
    if p.kind is bool:
        return None if type(value) is bool else f"{name} must be true or false"
    if p.kind is dict:
        values = list(value.values()) if isinstance(value, dict) else [None]
        if all(type(v) in (int, float) and bounds.holds(v) for v in values):
            return None
        return f"{name} must map token ids to finite numbers in {bounds.text()}"
    if p.kind is int:
        ok = type(value) is int
    else:
        ok = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
    if not ok or not bounds.holds(value):  # type: ignore[arg-type]
        kind = "an integer" if p.kind is int else "a finite number"
        return f"{name} must be {kind} in {bounds.text()}"
    return None


ParamValue = int | float | dict[str, float]  # a declared parameter's value, as given


def given(req: object, api: str) -> dict[str, ParamValue]:
    """The declared parameters `req` (a parsed request of `api`) names: what a
    translation into the internal request carries over."""
    return {p.name: v for p in params_in(api) if (v := getattr(req, p.name, None)) is not None}
