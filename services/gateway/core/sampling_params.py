"""OpenAI sampling and logprobs fields → the `Generate` fields rank 0 plans with: its
`Sampling` record and `top_logprobs`.

The request's own ranges are checked by the schema (openai/schemas.py, one 400 naming
the field); what needs the model's tokenizer (logit_bias token ids) and what spans two
fields (top_logprobs needs logprobs) is checked here, before any GENERATE is sent, with
the same bounds rank 0 checks again (services/rank/leader.py `validate`).

The parameters themselves (ranges, "off" values, which a deployment may default) are
declared once in common/request_params.py; each API's fields are built from that here
(`ParamFields`). A field the request omits takes the deployment's sampling default
(common/sampling_defaults.py, filled in here at admission); the others' defaults mean
"off" and are the wire's. vLLM's OpenAI server is the reference where OpenAI is silent:
`top_k` -1 or 0 is off; `repetition_penalty` 1 is off; `repetition_context_size`
(mlx-lm's name, an extension) is how many of the latest tokens it looks at.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo

from common import request_params
from common.messages import Sampling, TokenBias
from common.request_params import BIAS_LIMIT, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Param, ParamValue
from common.sampling_defaults import SamplingDefaults
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError

__all__ = ["MAX_TOP_LOGPROBS", "ParamFields", "logit_bias", "params_model", "sampling_for"]


def _field(p: Param, api: str) -> tuple[type, FieldInfo]:
    if p.kind is dict:  # its values are checked with the vocabulary, at admission
        return dict[str, float] | None, Field(default=None)
    if p.kind is bool:  # true or false, not "yes" or 1
        return bool | None, Field(default=None, strict=True)
    extra = {"allow_inf_nan": False} if p.kind is float else {}
    return p.kind | None, Field(default=None, **p.bounds_in(api).pydantic(), **extra)


def params_model(api: str) -> type[BaseModel]:
    """A mixin with one optional field per parameter `api` takes, typed and bounded as
    common/request_params.py declares it (no config of its own: the request's applies)."""
    fields = {p.name: _field(p, api) for p in request_params.params_in(api)}
    return create_model(f"{api.title()}Params", **fields)  # type: ignore[call-overload]


class ParamFields:
    """Each API's mixin, built once at import."""

    CHAT = params_model(request_params.CHAT)
    COMPLETIONS = params_model(request_params.COMPLETIONS)
    RESPONSES = params_model(request_params.RESPONSES)
    MESSAGES = params_model(request_params.MESSAGES)


class SamplingFields(ParamFields.CHAT):  # type: ignore[misc, valid-type]
    """What chat and completions share: the declared parameters (same bounds in both),
    mixed into openai/schemas.py's _Sampling."""


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


def sampling_for(params: Mapping[str, ParamValue], tok: ModelTokenizer,
                 defaults: SamplingDefaults, *, seed: int, grammar: str = "") -> Sampling:
    """The `Sampling` record of one `Generate` for this request: each declared parameter
    from the request, else the deployment's default, else its "off" value; `seed` and
    `grammar` as admission made them."""
    values: dict[str, ParamValue] = {}
    for p in request_params.WIRE:
        value = params.get(p.name)
        if value is None:
            value = getattr(defaults, p.name) if p.deployable else p.off
        values[p.name] = p.kind(value)
    if values["top_k"] < 0:
        values["top_k"] = 0  # -1 and 0 both mean off; the wire says 0
    bias = params.get("logit_bias")
    return Sampling(**values, seed=seed, grammar=grammar,
                    logit_bias=logit_bias(bias if isinstance(bias, dict) else None, len(tok.hf)))
