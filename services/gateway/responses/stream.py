"""Responses objects and their typed SSE events, from a `Generation`'s events.

One `Output` builder turns the events into output items for both forms, so a streamed
response and a collected one are the same items:

- reasoning → a `reasoning` item, its text as `reasoning_text` content
  (`response.reasoning_text.delta` / `.done`);
- text → a `message` item with one `output_text` part (`response.output_text.delta`s,
  with their tokens' logprobs when `include` asks); whitespace before a new message's
  first visible character is held, so no message is whitespace alone;
- a tool call → a `function_call` item whose arguments arrive as one
  `response.function_call_arguments.delta` of the complete JSON (a call is only emitted
  once its parser accepted all of it), then `.done`; calls past `max_tool_calls` are
  dropped; a namespaced function's call carries its inner `name` and its `namespace`
  (responses/tools.py);
- keepalive → an SSE comment; nothing else is a typed event.

Stream: response.created, response.in_progress, per item output_item.added /
(content_part.added, deltas, .done, content_part.done) / output_item.done, then
response.completed — or response.incomplete (max_output_tokens reached, as OpenAI's) or
response.failed (an error or an abort after the stream started). Every event carries
`sequence_number`, from 0.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from services.gateway.core import logprobs as lp
from services.gateway.core.generation import (
    EndEvent,
    Final,
    Finish,
    Generation,
    KeepaliveEvent,
    LogprobsEvent,
    ReasoningEvent,
    TextEvent,
    ToolCallEvent,
)
from services.gateway.core.generation import Event as GenerationEvent
from services.gateway.core.streaming import run_to_end
from services.gateway.core.toolcalls import ToolCall
from services.gateway.responses.schemas import ResponsesRequest

KEEPALIVE = b": keep-alive\n\n"
Event = tuple[str, dict]


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Output:
    """Output items built from generation events; `feed` returns the typed events (without
    sequence numbers: `Sequencer` numbers them)."""

    def __init__(self, logprobs: bool = False, max_calls: int | None = None,
                 namespaces: dict[str, tuple[str, str]] | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.held = ""
        self.logprobs = logprobs
        self.pending: list[lp.TokenLogprob] = []
        self.max_calls = max_calls
        self.calls = 0
        self.namespaces = namespaces or {}  # qualified name → (namespace, inner name)

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict) -> list[Event]:
        out = self.close()
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": self._index(),
                 "item": json.loads(json.dumps(item))}
        out.append(added)
        if item["type"] in ("message", "reasoning"):
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            out.append(self._at({"type": "response.content_part.added",
                                 "part": dict(part, logprobs=[]) if item["type"] == "message"
                                 else dict(part)}))
        return out

    def _at(self, ev: dict) -> dict:
        item = self.items[-1]
        ev = {**ev, "item_id": item["id"], "output_index": self._index()}
        if item["type"] != "function_call":
            ev["content_index"] = 0
        return ev

    def close(self) -> list[Event]:
        item = self.open
        if item is None:
            return []
        out: list[dict] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" \
                else "response.reasoning_text.done"
            ev = {"type": done, "text": part["text"]}
            if item["type"] == "message":
                ev["logprobs"] = part["logprobs"]
            out.append(self._at(ev))
            out.append(self._at({"type": "response.content_part.done", "part": dict(part)}))
        elif item["type"] == "function_call":
            out.append(self._at({"type": "response.function_call_arguments.done",
                                 "name": item["name"], "arguments": item["arguments"]}))
        item["status"] = "completed"
        out.append({"type": "response.output_item.done", "output_index": self._index(),
                    "item": json.loads(json.dumps(item))})
        self.open = None
        self.held = ""
        return out

    def _take_logprobs(self) -> list[dict]:
        out, self.pending = self.pending, []
        return lp.chat(out)["content"] if out and self.logprobs else []

    def feed(self, ev: GenerationEvent) -> list[dict]:
        if isinstance(ev, LogprobsEvent):
            self.pending += ev.entries
            return []
        if isinstance(ev, TextEvent) and ev.text:
            val = ev.text
            out: list[dict] = []
            if self.open is None or self.open["type"] != "message":
                val = self.held + val
                if not val.strip():
                    self.held = val
                    return []
                out = self._start({"id": item_id("msg"), "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []})
            part = self.open["content"][0]
            part["text"] += val
            lps = self._take_logprobs()
            part["logprobs"] += lps
            return out + [self._at({"type": "response.output_text.delta", "delta": val,
                                    "logprobs": lps})]
        if isinstance(ev, ReasoningEvent) and ev.text:
            out = [] if self.open is not None and self.open["type"] == "reasoning" else \
                self._start({"id": item_id("rs"), "type": "reasoning", "summary": [],
                             "content": [], "status": "in_progress"})
            self.open["content"][0]["text"] += ev.text
            return out + [self._at({"type": "response.reasoning_text.delta", "delta": ev.text})]
        if isinstance(ev, ToolCallEvent):
            call: ToolCall = ev.call
            self.pending = []
            if self.max_calls is not None and self.calls >= self.max_calls:
                return []
            self.calls += 1
            ns, name = self.namespaces.get(call.name, (None, call.name))
            out = self._start({"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call",
                               "call_id": call.id, "name": name,
                               **({"namespace": ns} if ns else {}), "arguments": "",
                               "status": "in_progress"})
            self.open["arguments"] = call.arguments
            out.append(self._at({"type": "response.function_call_arguments.delta",
                                 "delta": call.arguments}))
            return out + self.close()
        return []


class Sequencer:
    """Numbers events from 0 and renders them as SSE (`event:` = the type)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, ev: dict) -> bytes:
        ev = {"type": ev["type"], "sequence_number": self.n,
              **{k: v for k, v in ev.items() if k != "type"}}
        self.n += 1
        return (f"event: {ev['type']}\ndata: ".encode()
                + json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


def usage(final: Final | None) -> dict | None:
    if final is None:
        return None
    return {"input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
            "total_tokens": final.prompt_tokens + final.completion_tokens}


class Envelope:
    """The response object around the output: the request's settings echoed, status,
    usage, error."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest) -> None:
        self.rid, self.model, self.req = rid, model, req
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict], final: Final | None = None,
             error: dict | None = None) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) \
            if r.text and r.text.format else {"type": "text"}
        tc = r.tool_choice if r.tool_choice is not None else "auto"
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status, "background": bool(r.background), "error": error,
            "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "max_tool_calls": r.max_tool_calls,
            "model": self.model, "output": json.loads(json.dumps(output)),
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": r.reasoning.summary if r.reasoning else None},
            "store": r.stored(), "temperature": r.temperature,
            "text": {"format": fmt, "verbosity": None}, "tool_choice": tc,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_logprobs": r.top_logprobs, "top_p": r.top_p, "truncation": "disabled",
            "usage": usage(final), "user": r.user, "metadata": r.metadata or {},
            "service_tier": "default", "prompt_cache_key": r.prompt_cache_key,
            "safety_identifier": r.safety_identifier,
        }


def status_of(final: Final) -> str:
    if final.error is not None or final.finish_reason == Finish.ABORT:
        return "failed"
    return "incomplete" if final.finish_reason == Finish.LENGTH else "completed"


def error_of(final: Final) -> dict | None:
    """The response's `error` object for a failed one (OpenAI's codes: server_error,
    rate_limit_exceeded)."""
    if final.error is not None:
        code = "rate_limit_exceeded" if final.error.status == 429 else "server_error"
        return {"code": code, "message": final.error.message}
    if final.finish_reason == Finish.ABORT:
        return {"code": "server_error", "message": "the request was aborted on the server "
                f"({final.abort_reason or 'abort'}); retry"}
    return None


async def collect(gen: Generation, out: Output) -> Final:
    """Run a generation to its end, building its items (non-streaming)."""
    return await run_to_end(gen, out.feed, out.close)


async def stream(gen: Generation, out: Output, env: Envelope, on_end):
    """The SSE bytes of one response; `on_end(final, body)` gets the Final and the final
    response object (release, metrics, store)."""
    seq = Sequencer()
    snapshot = env.body("in_progress", [])
    yield seq({"type": "response.created", "response": snapshot})
    yield seq({"type": "response.in_progress", "response": snapshot})
    async for ev in gen.events():
        if isinstance(ev, KeepaliveEvent):
            yield KEEPALIVE
            continue
        if not isinstance(ev, EndEvent):
            events = out.feed(ev)
            if events:
                gen.mark_visible()
            for e in events:
                yield seq(e)
            continue
        final = ev.final
        for e in out.close():
            yield seq(e)
        status = status_of(final)
        body = env.body(status, out.items, final, error_of(final))
        on_end(final, body)
        yield seq({"type": f"response.{status}", "response": body})
        return
