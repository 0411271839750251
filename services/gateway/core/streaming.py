"""OpenAI bodies and SSE streams for chat and text completions, and an ASGI response
that notices a client disconnect the moment it happens (not at the next write).

Stream layout (chat): a role chunk, content / tool_calls delta chunks, a finish chunk
(carrying `lockstep.ttft_*_ms`), with `stream_options.include_usage` a usage chunk with
empty `choices`, then `data: [DONE]`. Comment lines (`: keep-alive`) are sent while the
model is quiet. An error after the stream started is an `error` event, then [DONE];
an aborted request ends with finish_reason "abort", never a broken transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response

from services.gateway.core import logprobs as lp
from services.gateway.core.generation import (
    EndEvent,
    Event,
    Final,
    Generation,
    KeepaliveEvent,
    LogprobsEvent,
    ReasoningEvent,
    TextEvent,
    ToolCallEvent,
)
from services.gateway.core.toolcalls import ToolCall

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Shape:
    """The envelope of one response: chat or text completion."""

    def __init__(self, chat: bool, rid: str, model: str, include_usage: bool = False,
                 logprobs: bool = False) -> None:
        self.chat, self.rid, self.model = chat, rid, model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs  # asked for: every choice carries its tokens' logprobs
        self._completion_lp = lp.CompletionShaper()

    def _lp(self, entries: list[lp.TokenLogprob] | None) -> dict | None:
        if not self.logprobs or entries is None:
            return None
        return lp.chat(entries) if self.chat else self._completion_lp(entries)

    def chunk(self, *, text: str | None = None, role: bool = False, index: int = 0,
              reasoning: str | None = None,
              tool_call: tuple[int, ToolCall] | None = None, finish: str | None = None,
              extra: dict | None = None, logprobs: list[lp.TokenLogprob] | None = None) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            if text is not None:
                delta["content"] = text
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if tool_call is not None:
                delta["tool_calls"] = [tool_call[1].to_openai(tool_call[0])]
            choice = {"index": index, "delta": delta, "logprobs": self._lp(logprobs),
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._lp(logprobs),
                      "finish_reason": finish}
            obj = "text_completion"
        out = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        if extra:
            out.update(extra)
        return out

    def usage_chunk(self, final: Final) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": final.usage(), "lockstep": final.timings()}

    def body(self, text: str, final: Final, index: int = 0, reasoning: str = "") -> dict:
        if self.chat:
            msg: dict = {"role": "assistant", "content": text or (None if final.tool_calls else "")}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if final.tool_calls:
                msg["tool_calls"] = [c.to_openai() for c in final.tool_calls]
            choice = {"index": index, "message": msg, "logprobs": self._lp(final.logprobs),
                      "finish_reason": final.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": index, "text": text, "logprobs": self._lp(final.logprobs),
                      "finish_reason": final.finish_reason}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": final.usage(), "lockstep": final.timings()}


async def run_to_end(gen: Generation, feed: Callable[[Event], Any],
                     close: Callable[[], Any] | None = None) -> Final:
    """Run a generation to its end for a non-streamed answer: every event before the
    final one to `feed(event)`, then `close()`; the final event's Final, whose visible
    TTFT is now (the whole body is the first visible byte)."""
    async for ev in gen.events():
        if isinstance(ev, EndEvent):
            if close is not None:
                close()
            gen.mark_visible()
            ev.final.visible_ttft_ms = (gen.visible_at - gen.started_at) * 1000
            return ev.final
        feed(ev)
    raise RuntimeError("generation ended without a final event")


async def collect(gen: Generation, prefix: str = "") -> tuple[str, Final]:
    """Run a generation to its end (non-streaming): its text after `prefix`, its Final."""
    parts = [prefix] if prefix else []
    final = await run_to_end(gen, lambda ev: parts.append(ev.text) if isinstance(ev, TextEvent) else None)
    return "".join(parts), final


async def sse_events(gen: Generation, shape: Shape, prefix: str = "",
                     on_end: Callable[[Final], None] | None = None, *, index: int = 0,
                     tail: bool = True) -> AsyncIterator[bytes]:
    """SSE bytes for one generation (choice `index`); `on_end` gets the Final (metrics,
    release). Without `tail` the usage chunk and [DONE] are left to the caller (n > 1:
    choices.py merges the streams of several)."""
    n_calls = 0
    pending: list[lp.TokenLogprob] = []  # logprobs of tokens whose text is not out yet

    def take() -> list[lp.TokenLogprob] | None:
        nonlocal pending
        out, pending = (pending or None), []
        return out

    if shape.chat:
        yield sse(shape.chunk(role=True, index=index))
    if prefix:  # echo
        gen.mark_visible()
        yield sse(shape.chunk(text=prefix, index=index))
    async for ev in gen.events():
        match ev:
            case KeepaliveEvent():
                yield KEEPALIVE
            case LogprobsEvent(entries):
                pending += entries
            case TextEvent(text):
                gen.mark_visible()
                yield sse(shape.chunk(index=index, text=text, logprobs=take()))
            case ReasoningEvent(text):
                gen.mark_visible()
                yield sse(shape.chunk(index=index, reasoning=text))
            case ToolCallEvent(call):
                gen.mark_visible()
                yield sse(shape.chunk(index=index, tool_call=(n_calls, call), logprobs=take()))
                n_calls += 1
            case EndEvent(final):
                if on_end is not None:
                    on_end(final)
                if final.error is not None:
                    yield sse(final.error.body())
                else:
                    yield sse(shape.chunk(index=index, finish=final.finish_reason, logprobs=take(),
                                          extra={"lockstep": final.timings()}))
                    if shape.include_usage and tail:
                        yield sse(shape.usage_chunk(final))
                if tail:
                    yield DONE
                return


class EventStreamResponse(Response):
    """Streams `body` as text/event-stream; calls `on_disconnect` as soon as the client
    goes away (a listener awaits `http.disconnect` alongside the writer)."""

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        # Response.__init__ is skipped on purpose: it would set a content-length.
        self.body_iter = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        hdrs = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                "x-accel-buffering": "no", **(headers or {})}
        self.raw_headers = [(k.lower().encode(), v.encode()) for k, v in hdrs.items()]

    async def __call__(self, scope, receive, send) -> None:
        raw = self.raw_headers
        gone = asyncio.Event()

        async def listen() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    self.on_disconnect()
                    pump.cancel()
                    return

        async def write() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            async for chunk in self.body_iter:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump = asyncio.ensure_future(write())
        listener = asyncio.ensure_future(listen())
        try:
            await pump
        except asyncio.CancelledError:
            if not gone.is_set():  # not the client leaving: the server cancelled us
                self.on_disconnect()
                raise
        except OSError:  # the transport broke under a write
            self.on_disconnect()
        finally:
            listener.cancel()
            pump.cancel()
            with contextlib.suppress(BaseException):
                await listener
            with contextlib.suppress(BaseException):
                await self.body_iter.aclose()
