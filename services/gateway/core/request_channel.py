"""One deployment's request channel: a signed DEALER to rank 0, the streams in flight
on it, and the bookkeeping that keeps the gateway's active counter honest.

A stream is *active* from the moment its GENERATE is sent until the gateway knows the
request left the batch: rank 0's final TOKENS arrived (stop, length, abort, error), or
rank 0 no longer lists it (STATS), or the deployment is gone. The consumer (the HTTP
handler) `release`s a stream when it is done with it; releasing an unfinished stream
sends ABORT at once and a drain task waits for the final chunk. Streams whose consumer
went away without releasing (an orphan) are reaped by `reap_orphans` after a grace
period. Active means registered in `streams`, the one place a request id lives here
(the client routes rank 0's chunks through it); every way out — release, drain, reap,
rank 0 lost, the deployment gone, resumed elsewhere — is `RequestStream.close`.

Admission: at most `max_inflight` streams are active at once (running and waiting on
rank 0, released ones still draining included); beyond that `generate` (and
`check_room`, called before any tokenizing) raises `Overloaded`, a 429 with
`retry-after`. Rank 0 keeps its own bound (several gateways may share it) and refuses
in-band with error_code overloaded: the stream's `refusal` is then the same 429.
Both are counted in `overloads` by bound ("gateway", "rank").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from common.bus import BusTimeout, Channel, new_request_id
from common.deployment_info import DeploymentInfo
from common.envelope import Key
from common.messages import (
    REQUESTS_OUT,
    Abort,
    ErrorCode,
    FinishReason,
    Generate,
    Stats,
    StatsRequest,
)
from common.rpc_client import AsyncRpcClient
from services.gateway.core.cache_index import follow
from services.gateway.core.rank_link import DEALER_OPTIONS, LinkWatch
from services.gateway.core.refusals import SEND_TIMEOUT_S, Bound, Cancelled, Overloaded, Unavailable
from services.gateway.core.request_stream import RequestStream

# Overloaded, Unavailable (refusals.py) and RequestStream (request_stream.py) are named
# here too: the channel is where callers meet them.
__all__ = ["Backend", "Overloaded", "RequestStream", "Unavailable"]

log = logging.getLogger("lockstep.gateway.request_channel")


class Backend:
    def __init__(self, ctx: zmq.asyncio.Context, info: DeploymentInfo, *, key: Key,
                 on_abort: Callable[[str], None] | None = None,
                 orphan_grace_s: float = 5.0,
                 max_inflight: int = 0, retry_after_s: int = 1) -> None:
        self.deployment_id = info.deployment_id
        self.job_id = info.job_id
        self.model = info.model or self.deployment_id
        self.model_path = info.model_path
        self.endpoint = info.requests_endpoint
        # what requests that name no temperature / top_p / ... are sampled with
        self.sampling = info.sampling
        # The one registry of this deployment's requests (request id → stream): admission
        # counts it, the client routes rank 0's chunks through it, `RequestStream.close`
        # is the only way out.
        self.streams: dict[str, RequestStream] = {}
        # `key`: the requests key, opened from the sealed admin-reply field by the caller
        # (common.keys.requests_key_of).
        channel = Channel("gateway", "requests", sender="gateway", send_key=key, accept=REQUESTS_OUT)
        self.client = AsyncRpcClient(ctx, self.endpoint, channel, options=DEALER_OPTIONS,
                                     route=self.streams.get)
        # Rank 0 lost is seen here, at once (rank_link.py): its streams fail in-band.
        self.link = LinkWatch(self.client.sock, self.endpoint, self.fail_lost)
        self.cache_index = follow(self.client)  # rank 0's prefix cache, from its events
        self.lost: str | None = None  # why rank 0 is lost: not routed to any more
        self.draining = False  # an operator's unload: no new requests, in-flight ones finish
        self.orphan_grace_s = orphan_grace_s
        self.max_inflight = max_inflight  # 0: no bound
        self.retry_after_s = retry_after_s
        self.overloads: collections.Counter[Bound] = collections.Counter()  # by bound
        self.tokens_out = 0  # completion tokens taken from rank 0 (the console's rate)
        self.last_ok_at: float | None = None  # wall clock of the last good generation
        self.closed = False
        self._on_abort = on_abort or (lambda cause: None)
        self._tasks: set[asyncio.Task] = set()
        self._drained = asyncio.Event()
        self._drained.set()

    # --- requests ------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self.streams)

    def full(self, more: int = 1) -> bool:
        return bool(self.max_inflight) and len(self.streams) + more > self.max_inflight

    def check_room(self, more: int = 1, held: int = 0) -> None:
        """Raise Overloaded if `more` requests would exceed the bound on in flight, with
        room `held` for that many continuations first (app.pick)."""
        n = len(self.streams)
        if self.max_inflight and n + more + held > self.max_inflight:
            self.overloads[Bound.GATEWAY] += 1
            raise Overloaded(self, Bound.GATEWAY, n, held)

    async def generate(self, gen: Generate, cached: int = 0) -> RequestStream:
        """Send `gen`; `cached`: the prompt tokens the router expects rank 0's cache to
        hold (services/gateway/core/router.py counts the rest as this deployment's load)."""
        if self.closed:
            raise Unavailable(self, "the deployment is gone")
        if self.lost:
            raise Unavailable(self, self.lost)
        self.check_room()  # no await before the stream is registered: the bound holds
        s = RequestStream(self, gen.request_id, len(gen.prompt))
        s.tenant = gen.tenant
        s.route_cached = cached
        self._register(s)
        try:
            await asyncio.wait_for(self.client.send(gen), SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            s.close()
            raise Unavailable(self, f"rank 0 does not take requests ({self.endpoint})") from None
        except BaseException:
            s.close()
            raise
        return s

    async def adopt(self, s: RequestStream, gen: Generate, cached: int = 0) -> None:
        """Send `gen` (a continuation) and move the stream `s` here, under gen's id;
        until its first token it weighs as a prefill of gen's prompt less `cached`
        (router.py's load), as a new request does.
        Cancelled if `s` was released or aborted meanwhile: checked with no await before
        the move, so a cancel is either seen here or reaches the stream on its new rank."""
        if s.released or s.abort_reason is not None:
            raise Cancelled(s.abort_reason or "client gone")
        if self.closed:
            raise Unavailable(self, "the deployment is gone")
        if self.lost:
            raise Unavailable(self, self.lost)
        s.rebind(self, gen.request_id, len(gen.prompt), cached)
        self._register(s)
        try:
            await asyncio.wait_for(self.client.send(gen), SEND_TIMEOUT_S)
        except BaseException as exc:
            s.close()
            s.finished = True  # nothing runs for it here
            if isinstance(exc, asyncio.TimeoutError):
                raise Unavailable(self, f"rank 0 does not take requests ({self.endpoint})") \
                    from None
            raise

    def forget(self, s: RequestStream) -> None:
        """`s` goes on elsewhere: stop counting it here, and if this rank 0 may still run
        it (its link came back), ABORT it (a new id elsewhere: never run twice)."""
        s.close()
        if not self.closed:
            self._spawn(self._send_abort(s.request_id, "resumed_elsewhere"))

    def abort(self, s: RequestStream, reason: str) -> None:
        """ABORT to rank 0 now (idempotent per stream); the consumer keeps reading."""
        if s.finished or s.abort_reason is not None:
            return
        s.abort_reason = reason
        self._on_abort(reason)
        self._spawn(self._send_abort(s.request_id, reason))

    def release(self, s: RequestStream, abort_reason: str | None) -> None:
        if s.released:
            return
        s.released = True
        if s.finished or s.queue.final_at is not None:
            if s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.last_ok_at = time.time()
            s.close()
            return
        self.abort(s, abort_reason or "client")
        self._spawn(self._drain(s))

    async def _send_abort(self, request_id: str, reason: str) -> None:
        try:
            await self.client.send(Abort(request_id=request_id, reason=reason))
        except Exception as exc:  # noqa: BLE001 - a closed socket during shutdown
            log.warning("abort %s to %s failed: %s", request_id, self.deployment_id, exc)

    async def _drain(self, s: RequestStream) -> None:
        """Wait for the final chunk of a released stream; verify with STATS if it is late."""
        deadline = time.monotonic() + 3 * self.orphan_grace_s
        while s.request_id in self.streams:
            left = min(self.orphan_grace_s, deadline - time.monotonic())
            if left <= 0:
                log.warning("request %s on %s: no final chunk after abort; forgotten",
                            s.request_id, self.deployment_id)
                break
            body = await s.next(left)
            if body is not None:
                if s.finished:
                    break
                continue
            ids = await self.active_ids(timeout=min(2.0, self.orphan_grace_s))
            if ids is not None and s.request_id not in ids:
                break  # rank 0 no longer has it: the final chunk was lost
            await self._send_abort(s.request_id, s.abort_reason or "client")
        s.close()

    def reap_orphans(self, now: float | None = None) -> int:
        """Unregister streams whose backend finished but whose consumer is gone."""
        now = time.monotonic() if now is None else now
        n = 0
        for s in list(self.streams.values()):
            if s.released or s.waiting:
                continue
            final_at = s.queue.final_at
            if final_at is not None and now - max(final_at, s.consumer_seen) > self.orphan_grace_s:
                log.info("reaped orphaned stream %s on %s", s.request_id, self.deployment_id)
                self._on_abort("orphan")
                s.close()
                n += 1
        return n

    def _register(self, s: RequestStream) -> None:
        self.streams[s.request_id] = s
        self._drained.clear()

    def unregister(self, s: RequestStream) -> None:
        """`s` leaves the registry (RequestStream.close, the one caller)."""
        self.streams.pop(s.request_id, None)
        if not self.streams:
            self._drained.set()

    # --- whole-deployment operations ----------------------------------------------

    async def stats(self, timeout: float = 2.0) -> Stats:
        msg = await self.client.call(StatsRequest(request_id=new_request_id()), timeout)
        return msg.body

    async def active_ids(self, timeout: float = 2.0) -> set[str] | None:
        try:
            return set((await self.stats(timeout)).active_ids)
        except (BusTimeout, AttributeError):
            return None

    def abort_local(self, reason: str) -> int:
        """Abort every running stream here (ABORT to rank 0 for each); count them."""
        n = 0
        for s in list(self.streams.values()):
            if not s.finished and s.abort_reason is None:
                self.abort(s, reason)
                n += 1
        return n

    def fail_lost(self, reason: str) -> None:
        """The link to rank 0 closed: every stream whose final chunk has not arrived ends
        now with error_code rank_lost (a 502, or an SSE error event then [DONE]), and the
        deployment is not routed to any more (cluster_view.py decides when it is again)."""
        self.lost = reason
        for s in list(self.streams.values()):
            if s.queue.final_at is None:
                s.end_here(FinishReason.ERROR, reason, ErrorCode.RANK_LOST)
                s.close()

    def fail_all(self, reason: str, failed: bool = False) -> None:
        """The deployment is gone: end every stream, forget them all. `failed`: it failed
        (typed deployment_failed: the request may resume); else a cancellation (abort)."""
        for s in list(self.streams.values()):
            if failed:
                s.end_here(FinishReason.ERROR, reason, ErrorCode.DEPLOYMENT_FAILED)
            else:
                s.end_here(FinishReason.ABORT, reason)
            s.close()

    async def wait_drained(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return not self.streams

    async def settle(self, timeout: float) -> int:
        """After a cluster abort: forget streams rank 0 no longer lists. Returns active."""
        if await self.wait_drained(min(timeout, 1.0)):
            return 0
        ids = await self.active_ids(timeout=max(0.5, min(2.0, timeout)))
        if ids is not None:
            for s in list(self.streams.values()):
                if s.request_id not in ids and (s.released or s.abort_reason):
                    if s.queue.final_at is None:  # its final chunk was lost: end it here
                        s.end_here(FinishReason.ABORT)
                    s.close()
        await self.wait_drained(max(0.0, timeout - 1.0) if ids is None else 0.5)
        return self.active

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def close(self, reason: str = "deployment gone", failed: bool = False) -> None:
        """End every stream (as fail_all). Requests still running get an ABORT queued
        with a short linger, so a gateway that stops does not leave them generating."""
        if self.closed:
            return
        self.closed = True
        for s in list(self.streams.values()):
            if not s.finished and s.queue.final_at is None:
                try:
                    self.client.sock.send(self.client.channel.pack(
                        Abort(request_id=s.request_id, reason="gateway")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self.fail_all(reason, failed)
        for t in list(self._tasks):
            t.cancel()
        self.link.close()
        self.client.close(linger=500)
