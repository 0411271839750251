"""Anthropic Messages responses from a `Generation`'s events: the message body, the SSE
event sequence, stop reasons, usage and errors in Anthropic's shape.

One `Blocks` builder turns the events into content blocks for both forms, so a streamed
message and a collected one are the same blocks:

- reasoning → a `thinking` block (`thinking_delta`s, then a `signature_delta`);
- text → a `text` block (`text_delta`s); whitespace before any visible character of a
  new block is held, so no block is whitespace alone;
- a tool call → a `tool_use` block whose `input` arrives as one `input_json_delta` of
  the complete arguments (a call is only emitted once its parser accepted all of it);
- keepalive → `ping`; logprobs → nothing (the Messages API has none).

Stream: message_start, ping, per block content_block_start / _delta... / _stop,
message_delta (stop_reason, stop_sequence, cumulative usage), message_stop. An error
after the stream started is `event: error` with Anthropic's error body.

Usage follows Anthropic's split: `input_tokens` are the prompt tokens not served from
the prefix cache, `cache_read_input_tokens` those that were (their sum is the prompt,
what count_tokens answers), `cache_creation_input_tokens` 0 (caching is automatic).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi.responses import JSONResponse

from services.gateway.core.errors import ApiError
from services.gateway.core.generation import (
    EndEvent,
    Final,
    Finish,
    Generation,
    KeepaliveEvent,
    ReasoningEvent,
    TextEvent,
    ToolCallEvent,
)
from services.gateway.core.generation import Event as GenerationEvent
from services.gateway.core.streaming import run_to_end
from services.gateway.core.toolcalls import ToolCall

# HTTP status → Anthropic error type (https://docs.claude.com/en/api/errors). Statuses
# are kept as the gateway answers them (the SDK maps each to its exception class).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               402: "billing_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
STOP_REASONS = {Finish.STOP: "end_turn", Finish.LENGTH: "max_tokens",
                Finish.TOOL_CALLS: "tool_use"}
# OpenAI parameter names in the shared path's errors → the Messages request's names.
PARAM_NAMES = (("response_format.json_schema.schema", "output_config.format.schema"),
               ("response_format", "output_config.format"),
               ("reasoning_effort", "output_config.effort"),
               ("tool_choice.function.name", "tool_choice.name"),
               ("stop", "stop_sequences"))


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def param_name(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("tools.") and param.endswith(".function.parameters"):
        return param[: -len(".function.parameters")] + ".input_schema"
    for old, new in PARAM_NAMES:
        if param == old or param.startswith(old + "."):
            return new + param[len(old):]
    return param


def error_body(e: ApiError, request_id: str | None = None) -> dict:
    """`{"type": "error", "error": {"type", "message"}, "request_id"}`; a parameter the
    shared path names by its OpenAI name is named as the Messages request spells it."""
    msg = e.message
    param = param_name(e.param)
    if param is not None and param != e.param:
        msg = f"{param}: {msg}"
    return {"type": "error", "error": {"type": error_type(e.status), "message": msg},
            "request_id": request_id or ("req_" + secrets.token_hex(12))}


def error_response(e: ApiError, request_id: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(e, request_id), status_code=e.status, headers=e.headers)


def aborted(final: Final) -> ApiError:
    """An abort (an operator's abort-all, an unload) has no stop_reason in the Messages
    API: the client gets an error it may retry, not a message that looks complete."""
    return ApiError(503, f"the request was aborted on the server ({final.abort_reason or 'abort'})"
                    "; retry", code="aborted")


def stop_reason(final: Final, gen: Generation) -> tuple[str, str | None]:
    if final.finish_reason == Finish.STOP and gen.stops.matched is not None \
            and not final.tool_calls:
        return "stop_sequence", gen.stops.matched
    return STOP_REASONS.get(final.finish_reason, "end_turn"), None


def usage(final: Final | None, prompt_tokens: int) -> dict:
    cached = final.cached_tokens if final is not None else 0
    prompt = final.prompt_tokens if final is not None else prompt_tokens
    return {"input_tokens": prompt - cached,
            "output_tokens": final.completion_tokens if final is not None else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


Event = tuple[str, dict]


class Blocks:
    """Content blocks built from generation events; `feed` returns the stream events."""

    def __init__(self, signature: str, omit_thinking: bool = False) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.kind: str | None = None  # the open block's type
        self.held = ""  # whitespace before a new text block's first visible character
        self.signature = signature
        self.omit_thinking = omit_thinking

    def _start(self, block: dict) -> list[Event]:
        out = self.close()
        self.blocks.append(block)
        self.kind = block["type"]
        return out + [("content_block_start", {"type": "content_block_start",
                                               "index": len(self.blocks) - 1,
                                               "content_block": dict(block)})]

    def _delta(self, delta: dict) -> Event:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.blocks) - 1, "delta": delta})

    def close(self) -> list[Event]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            self.blocks[-1]["signature"] = self.signature
            out.append(self._delta({"type": "signature_delta", "signature": self.signature}))
        self.kind = None
        self.held = ""
        return out + [("content_block_stop", {"type": "content_block_stop",
                                              "index": len(self.blocks) - 1})]

    def feed(self, ev: GenerationEvent) -> list[Event]:
        if isinstance(ev, TextEvent) and ev.text:
            val = ev.text
            out: list[Event] = []
            if self.kind != "text":
                val = self.held + val
                if not val.strip():
                    self.held = val
                    return []
                out = self._start({"type": "text", "text": ""})
                self.held = ""
            self.blocks[-1]["text"] += val
            return out + [self._delta({"type": "text_delta", "text": val})]
        if isinstance(ev, ReasoningEvent) and ev.text:
            out = [] if self.kind == "thinking" else self._start(
                {"type": "thinking", "thinking": "", "signature": ""})
            if self.omit_thinking:
                return out
            self.blocks[-1]["thinking"] += ev.text
            return out + [self._delta({"type": "thinking_delta", "thinking": ev.text})]
        if isinstance(ev, ToolCallEvent):
            call: ToolCall = ev.call
            out = self._start({"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                               "input": {}})
            self.blocks[-1]["input"] = json.loads(call.arguments)
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            return out + self.close()
        if isinstance(ev, KeepaliveEvent):
            return [("ping", {"type": "ping"})]
        return []


def message(rid: str, model: str, blocks: list[dict], reason: str | None, seq: str | None,
            use: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": seq, "usage": use}


def sse(name: str, data: dict) -> bytes:
    return (f"event: {name}\ndata: ".encode()
            + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


async def collect(gen: Generation, blocks: Blocks) -> Final:
    """Run a generation to its end, building its blocks (non-streaming)."""
    return await run_to_end(gen, blocks.feed, blocks.close)


async def stream(gen: Generation, blocks: Blocks, rid: str, model: str, prompt_tokens: int,
                 on_end):
    """The SSE bytes of one message; `on_end` gets the Final (release, metrics)."""
    start = message(rid, model, [], None, None, usage(None, prompt_tokens))
    yield sse("message_start", {"type": "message_start", "message": start})
    yield sse("ping", {"type": "ping"})
    async for ev in gen.events():
        if not isinstance(ev, EndEvent):
            events = blocks.feed(ev)
            if events and not isinstance(ev, KeepaliveEvent):
                gen.mark_visible()
            for name, data in events:
                yield sse(name, data)
            continue
        final = ev.final
        on_end(final)
        for name, data in blocks.close():
            yield sse(name, data)
        error = final.error or (aborted(final) if final.finish_reason == Finish.ABORT else None)
        if error is not None:
            yield sse("error", error_body(error, rid))
            return
        reason, seq = stop_reason(final, gen)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                                    "usage": usage(final, prompt_tokens)})
        yield sse("message_stop", {"type": "message_stop"})
        return
