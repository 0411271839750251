"""OpenAI sampling and logprobs fields → the `Generate` fields rank 0 plans with: its
`Sampling` record and `top_logprobs`.

The request's own ranges are checked by the schema (openai_schemas.py, one 400 naming
the field); what needs the model's tokenizer (logit_bias token ids) and what spans two
fields (top_logprobs needs logprobs) is checked here, before any GENERATE is sent, with
the same bounds rank 0 checks again (services/rank/leader.py `validate`).

A field the request omits takes the deployment's sampling default (temperature, top_p,
top_k, min_p, repetition_penalty: common/sampling_defaults.py, filled in here at
admission); the others' defaults mean "off" and are the wire's. vLLM's OpenAI server is the reference where OpenAI is silent:
`top_k` -1 or 0 is off; `repetition_penalty` 1 is off; `repetition_context_size`
(mlx-lm's name, an extension) is how many of the latest tokens it looks at.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from common.messages import Sampling, TokenBias
from common.sampling_defaults import SamplingDefaults
from services.gateway.detok import ModelTokenizer
from services.gateway.errors import ApiError

MAX_TOP_LOGPROBS = 20  # chat's bound (OpenAI); completions' `logprobs` is allowed as far
MAX_LOGIT_BIAS = 1024  # entries (the wire's bound, common/messages/base.py BIAS_LIST)
BIAS_LIMIT = 100.0
MAX_CONTEXT_SIZE = 1 << 20
MAX_TOP_K = 1 << 24  # above any vocabulary (a larger k keeps every token: the same as off)


class SamplingFields(BaseModel):
    """The fields both endpoints share, mixed into openai_schemas._Sampling."""

    model_config = ConfigDict(strict=True, extra="ignore")
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    repetition_context_size: int | None = Field(default=None, ge=1, le=MAX_CONTEXT_SIZE)
    logit_bias: dict[str, float] | None = None


def _bad(param: str, text: str) -> ApiError:
    return ApiError(400, f"invalid value for '{param}': {text}", param=param, code="invalid_value")


def logit_bias(raw: dict[str, float] | None, vocab: int) -> list[TokenBias]:
    """OpenAI's map of token id (a decimal string) → bias in [-100, 100]."""
    if not raw:
        return []
    if len(raw) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"{len(raw)} entries; at most {MAX_LOGIT_BIAS}")
    out = []
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise _bad("logit_bias", f"key {key[:32]!r} is not a token id")
        token = int(key)
        if token >= vocab:
            raise _bad("logit_bias", f"token id {token} is out of range [0, {vocab})")
        if not -BIAS_LIMIT <= bias <= BIAS_LIMIT:  # also refuses NaN
            raise _bad("logit_bias", f"bias {bias} for token {token} is outside [-100, 100]")
        out.append(TokenBias(token=token, bias=float(bias)))
    return sorted(out, key=lambda b: b.token)  # one order, whatever the JSON's


def top_logprobs(req: Any, *, chat: bool) -> int:
    """How many alternatives per token the client asked for; -1: no logprobs at all."""
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad("top_logprobs", "requires 'logprobs': true")
        if not req.logprobs:
            return -1
        return req.top_logprobs or 0
    if req.logprobs is None:
        return -1
    if req.echo:
        raise ApiError(400, "'logprobs' with 'echo' is not supported: prompt tokens have no "
                       "logprobs here", param="logprobs", code="unsupported_value")
    return req.logprobs


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_for(req: Any, tok: ModelTokenizer, defaults: SamplingDefaults, *, seed: int,
                 grammar: str = "") -> Sampling:
    """The `Sampling` record of one `Generate` for this request: its own values, else the
    deployment's defaults; `seed` and `grammar` as admission made them."""
    top_k = _or(req.top_k, defaults.top_k)
    return Sampling(
        temperature=float(_or(req.temperature, defaults.temperature)),
        top_p=float(_or(req.top_p, defaults.top_p)),
        seed=seed,
        top_k=0 if top_k < 0 else top_k,
        min_p=float(_or(req.min_p, defaults.min_p)),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=float(_or(req.repetition_penalty, defaults.repetition_penalty)),
        repetition_context_size=req.repetition_context_size or 20,
        logit_bias=logit_bias(req.logit_bias, len(tok.hf)),
        grammar=grammar,
    )
