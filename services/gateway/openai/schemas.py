"""OpenAI request schemas and their validation (strict types, clear 400s).

Parsing is by hand, not by FastAPI's body injection, so that every failure — invalid
JSON, wrong types, out-of-range values, unsupported options — becomes one
OpenAI-shaped error naming the offending parameter.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.core.errors import ApiError
from services.gateway.core.request_body import MAX_MESSAGES, MAX_STOPS, MAX_TOOLS, parse_json
from services.gateway.core.sampling_params import MAX_TOP_LOGPROBS, SamplingFields
from services.gateway.openai import fields

MAX_N = 16  # choices per request: each is its own request on rank 0


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # harmless: no obfuscation padding is sent


class TextPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's, for templates that show it


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Sampling(SamplingFields, _Strict):
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ENDPOINT: ClassVar[str]

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    ENDPOINT: ClassVar[str] = fields.CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # checked by structured.grammar_for
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(default=None, min_length=1, max_length=64)
    modalities: list[Literal["text"]] | None = None
    # Harmless (fields.ROWS): typed, so a malformed one is still a 400.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    prediction: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    ENDPOINT: ClassVar[str] = fields.COMPLETIONS
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    def limit(self) -> int | None:
        return self.max_tokens


def validate(cls: type[_Sampling], raw: bytes, *, max_messages: int = MAX_MESSAGES,
             max_tools: int = MAX_TOOLS) -> Any:
    """Parse and validate one request body (CPU-bound: callers off the event loop)."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    # Counts first: pydantic and the chat template cost per item.
    for name, most in (("messages", max_messages), ("tools", max_tools)):
        items = obj.get(name)
        if isinstance(items, list) and len(items) > most:
            raise ApiError(400, f"{len(items)} {name}; at most {most} per request",
                           param=name, code="too_many_items")
    fields.check(obj, cls.ENDPOINT, cls.model_fields)  # unknown / refused: by name
    try:
        req = cls.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "union[")))
        param = param or None
        raise ApiError(400, f"invalid value for '{param}': {first.get('msg')}",
                       param=param, code="invalid_value") from None
    _check_common(req)
    return req


def _check_common(req: _Sampling) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop sequences", param="stop", code="invalid_value")
    if isinstance(req, ChatRequest):
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text":
                        raise ApiError(400, f"content part type {part.type!r} is not supported "
                                       "(text only)", param=f"messages.{i}.content", code="unsupported_value")
        _check_tool_choice(req)
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, list) and len(p) and isinstance(p[0], str | list) and len(p) != 1:
            raise ApiError(400, "one prompt per request (a list of several prompts is not supported)",
                           param="prompt", code="unsupported_value")


def _check_tool_choice(req: ChatRequest) -> None:
    tc = req.tool_choice
    if tc is None or tc in ("none", "auto"):
        return
    if isinstance(tc, str) and tc != "required":
        raise ApiError(400, f"tool_choice {tc!r}: expected 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param="tool_choice",
                       code="invalid_value")
    # "required" and a named function are kept by constrained decoding (structured.py).
    fn = tc.get("function") if isinstance(tc, dict) else None
    if isinstance(tc, dict) and (tc.get("type") != "function" or not isinstance(fn, dict)
                                 or not isinstance(fn.get("name"), str)):
        raise ApiError(400, "tool_choice: expected {'type': 'function', 'function': "
                       "{'name': ...}}", param="tool_choice", code="invalid_value")
