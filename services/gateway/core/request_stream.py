"""One request's stream from rank 0, as the gateway's consumer (the HTTP handler, its
Generation) reads it: the chunks in order (`StreamQueue`), and what they said so far
(`RequestStream`: finished, finish reason, tokens, a rank-side refusal). A stream is
registered in one place, its deployment's channel (`Backend.streams`, request id →
stream; the channel's client routes rank 0's chunks through it), and leaves it by one
path, `close`. Release, abort and drain are the channel's (request_channel.Backend),
which `release` hands the stream to."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol

from common.messages import ErrorCode, FinishReason, Tokens
from services.gateway.core import refusals
from services.gateway.core.refusals import Bound, Overloaded


class Backend(refusals.Backend, Protocol):
    """What a stream asks of the channel it is registered in (request_channel.Backend):
    declared here, so this module needs nothing above it."""

    tokens_out: int
    overloads: collections.Counter[Bound]

    def abort(self, s: RequestStream, reason: str) -> None: ...

    def release(self, s: RequestStream, abort_reason: str | None) -> None: ...

    def unregister(self, s: RequestStream) -> None: ...


class StreamQueue:
    """A stream's chunks from rank 0, in order, and when the final one arrived.

    Not an asyncio.Queue: its consumer waits with a deadline for every chunk, and
    `asyncio.wait_for(queue.get(), t)` makes a Task, a timer and two loop turns per
    token; here a wait is one future and one timer handle (the gateway's per-token CPU
    is taken from the ranks on a small host)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.final_at: float | None = None

    def put_nowait(self, item) -> None:
        body = getattr(item, "body", item)
        if getattr(body, "finish_reason", None) and self.final_at is None:
            self.final_at = time.monotonic()
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get_within(self, timeout: float):
        """The next item, waiting at most `timeout` seconds; None if none came."""
        if not self._items:
            loop = asyncio.get_running_loop()
            w = self._waiter = loop.create_future()
            timer = loop.call_later(max(timeout, 0.0), _expire, w)
            try:
                await w
            finally:
                timer.cancel()
                # only our own: a consumer cancelled here (the client left) must not clear
                # the waiter of the drain that took over the stream, or the final chunk
                # would wake nobody and the drain would wait out its whole grace
                if self._waiter is w:
                    self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()


def _expire(w: asyncio.Future) -> None:
    if not w.done():
        w.set_result(None)


class RequestStream:
    def __init__(self, backend: Backend, request_id: str, prompt_len: int) -> None:
        self.backend = backend
        self.request_id = request_id
        self.tenant = ""  # the API key's name it runs for (its share: request_path.py)
        self.prompt_len = prompt_len
        self.queue = StreamQueue()
        self.submitted_at = time.monotonic()
        self.last_token_at = self.submitted_at
        self.consumer_seen = self.submitted_at
        self.waiting = False
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.released = False
        self.abort_reason: str | None = None
        self.refusal: Overloaded | None = None  # rank 0 refused it as overloaded
        # For the operator console (admin/console_api.py): what rank 0 has sent so far.
        self.generated = 0
        self.cached_tokens = 0
        self.model_ttft_ms: float | None = None
        self.first_token_at: float | None = None  # monotonic, as the gateway took it
        # what rank 0 prefills before its first token, and how much of it the router
        # expected cached (router.py load): the prompt; a continuation's prompt + output
        self.route_len, self.route_cached = prompt_len, 0

    async def next(self, timeout: float) -> Tokens | None:
        """The next chunk from rank 0, or None if none arrived within `timeout`."""
        self.waiting = True
        try:
            msg = await self.queue.get_within(timeout)
        finally:
            self.waiting = False
            self.consumer_seen = time.monotonic()
        return None if msg is None else self._take(msg)

    def ready(self) -> list[Tokens]:
        """Every chunk already queued (up to and including a final one), without waiting:
        a consumer that fell behind handles them as one."""
        out: list[Tokens] = []
        while not self.finished and not self.queue.empty():
            out.append(self._take(self.queue.get_nowait()))
        return out

    def _take(self, msg) -> Tokens:
        body: Tokens = getattr(msg, "body", msg)
        if body.tokens:
            self.last_token_at = self.consumer_seen
            self.generated += len(body.tokens)
            self.backend.tokens_out += len(body.tokens)
            self.first_token_at = self.first_token_at or self.consumer_seen
        elif body.waiting:  # rank 0 still holds it (queued, prefilling): not a stuck model
            self.last_token_at = self.consumer_seen
        self.cached_tokens = max(self.cached_tokens, body.cached_tokens)
        if self.model_ttft_ms is None and body.model_ttft_ms is not None:
            self.model_ttft_ms = body.model_ttft_ms
        if body.finish_reason:
            self.finished, self.finish_reason = True, body.finish_reason
            if body.error_code == ErrorCode.OVERLOADED and self.refusal is None:
                self.refusal = Overloaded(self.backend, Bound.RANK, None)
                self.backend.overloads[Bound.RANK] += 1
        return body

    def put_nowait(self, item) -> None:
        """A chunk from rank 0: the channel's client routes it here by request id."""
        self.queue.put_nowait(item)

    def close(self) -> None:
        """Leave the channel's registry, the one teardown: the stream no longer counts as
        active there (admission, drains), and rank 0's late chunks for it are dropped.
        Idempotent."""
        self.backend.unregister(self)

    def end_here(self, finish_reason: FinishReason, error: str | None = None,
                 error_code: ErrorCode | None = None) -> None:
        """End the stream at the gateway (rank 0 lost, the deployment gone, a final chunk
        that never came): the one final chunk not from rank 0, queued as rank 0 would
        send it, so the consumer reads every end the same way."""
        self.queue.put_nowait(Tokens(request_id=self.request_id, tokens=[], index=0,
                                     finish_reason=finish_reason, error=error,
                                     error_code=error_code))

    def release(self, abort_reason: str | None = None) -> None:
        """The consumer is done; abort rank-side if the request is still running."""
        self.backend.release(self, abort_reason)

    def rebind(self, backend: Backend, request_id: str, route_len: int, route_cached: int) -> None:
        """Go on as `request_id` on `backend` (a resumed request, services/gateway/core/resume.py):
        a fresh queue; what was received, the prompt length and the consumer stay — and
        so does a cancel (`abort_reason`): a resume never undoes one. Until its first
        token there it is a prefill of `route_len` tokens, `route_cached` of them cached."""
        self.backend, self.request_id = backend, request_id
        self.route_len, self.route_cached = route_len, route_cached
        self.first_token_at = None
        self.queue = StreamQueue()
        self.finished, self.finish_reason = False, None
        self.refusal = None
        self.last_token_at = time.monotonic()
