"""Request/reply clients over a DEALER socket: replies matched by request id, deadlines
on every call, no REQ state machine to wedge. `AsyncRpcClient` serves the gateway and
the supervisor's event loops; `SyncRpcClient` the CLI, tests and ranks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from common.bus import BusInterrupted, BusTimeout, Channel, configure
from common.envelope import Message

log = logging.getLogger("lockstep.bus")


class AsyncRpcClient:
    """DEALER client with request ids: replies are matched by `request_id`, so a
    timed-out call never wedges the socket (no REQ state machine), and late replies
    are dropped. Streams (many replies per id) get a queue via `open_stream`, or live in
    the owner's own registry, looked up through `route` (request id → something with
    `put_nowait`, or None): the gateway keeps each request in one place that way.

    The socket is a plain one, read from an event-loop reader callback rather than
    pyzmq's futures: every reply then costs one callback (no future, no Task wake-up
    per message): in the gateway that was ~200 of the ~870 µs of CPU a streamed token
    cost at concurrency 1.
    libzmq's FD is edge-triggered and a send can consume its signal, so the callback
    drains until EAGAIN and every send schedules one more look."""

    BURST = 64  # messages read per callback before letting other callbacks run

    def __init__(self, ctx: zmq.Context, endpoint: str, channel: Channel,
                 options: dict[int, int] | None = None,
                 route: Callable[[str], Any] | None = None) -> None:
        self.endpoint = endpoint
        self.channel = channel
        # A plain socket on the (asyncio) context: tracked by it (destroy closes it),
        # and its monitor (get_monitor_socket, rank_link.py) is still an asyncio one.
        self.sock = configure(ctx.socket(zmq.DEALER, socket_class=zmq.Socket))
        for opt, value in (options or {}).items():  # before connect: libzmq copies them then
            self.sock.setsockopt(opt, value)
        self.sock.connect(endpoint)
        self._fd = self.sock.FD
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, asyncio.Future] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._route_to = route  # the owner's registry, after `_streams`
        self._writable: list[asyncio.Future] = []  # sends waiting for room (POLLOUT)
        self._scheduled = False
        self.closed = False

    def start(self) -> None:
        if self._loop is None and not self.closed:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._on_events)
            self._look()  # replies may be queued already: the edge came before us

    def _look(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._on_events)

    def _on_events(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        try:
            events = self.sock.get(zmq.EVENTS)  # a wake-up with nothing to read: no recv
            if events & zmq.POLLIN:
                self._drain()
            if self._writable:
                # Fresh: the reads may have processed the command that made room, and
                # the FD does not signal what was processed already.
                if self.sock.get(zmq.EVENTS) & zmq.POLLOUT:
                    for fut in self._writable:
                        if not fut.done():
                            fut.set_result(None)
                    self._writable.clear()
        except zmq.ZMQError:  # closed under us (shutdown)
            return

    def _drain(self) -> None:
        for _ in range(self.BURST):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.channel.unpack_dealer(frames)
                if msg is None:
                    continue
                chunks = getattr(msg.body, "chunks", None)  # a batch: each to its stream
                for item in (msg,) if chunks is None else chunks:
                    self._route(item)
            except Exception:  # noqa: BLE001 - a bug here must not strand the rest unread
                log.exception("%s: handling a reply failed", self.endpoint)
        self._look()  # more may be queued: after the other ready callbacks

    def _route(self, item) -> None:
        """`item`: a Message, or one body out of a batch (consumers read `.body` if any)."""
        rid = getattr(getattr(item, "body", item), "request_id", None)
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(item)
            return
        q = self._streams.get(rid)
        if q is None and self._route_to is not None:
            q = self._route_to(rid)
        if q is not None:
            q.put_nowait(item)
        else:
            log.debug("%s: dropped late reply for %s", self.endpoint, rid)

    async def send(self, body: Any) -> None:
        """Queue `body` on the socket; while the queue is full (or no peer is connected)
        wait for room. Callers bound the wait with their own deadline."""
        self.start()
        data = self.channel.pack(body)
        while True:
            if self.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK, "socket closed")
            try:
                self.sock.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:
                fut = self._loop.create_future()
                self._writable.append(fut)
                self._look()  # room may have come before this wait began
                try:
                    await fut
                finally:
                    if fut in self._writable:
                        self._writable.remove(fut)
        self._look()  # the send may have taken the FD's edge for a queued reply

    async def call(self, body: Any, timeout: float) -> Message:
        self.start()
        rid = body.request_id
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut

        async def exchange() -> Message:
            await self.send(body)  # inside the deadline: a full send queue must not hang us
            return await fut

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise BusTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s") from None
        finally:
            self._waiters.pop(rid, None)

    def open_stream(self, request_id: str, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Route every reply for `request_id` into `queue` (a new one by default)."""
        self.start()
        q: asyncio.Queue = asyncio.Queue() if queue is None else queue
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def close(self, linger: int = 0) -> None:
        """Close; `linger` ms lets already queued messages (an ABORT) still go out."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        for fut in self._writable:
            if not fut.done():
                fut.cancel()
        self.sock.close(linger)


class SyncRpcClient:
    """Blocking DEALER client with deadlines (CLI, tests, ranks)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, channel: Channel) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.sock = configure(ctx.socket(zmq.DEALER))
        self.sock.connect(endpoint)

    def call(self, body: Any, timeout: float,
             interrupted: Callable[[], bool] | None = None) -> Message:
        """Send `body` and wait for its reply until `timeout`; with `interrupted`, the
        wait is sliced (0.2 s) so a caller's stop request ends it at once (BusInterrupted)."""
        deadline = time.monotonic() + timeout
        slice_ms = 200 if interrupted is not None else None
        payload = self.channel.pack(body)
        while True:  # a full send queue (peer gone) must not block past the deadline
            try:
                self.sock.send(payload, zmq.NOBLOCK)
                break
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BusTimeout(f"could not send to {self.endpoint} within {timeout:.1f}s") from None
                self.sock.poll(int(left * 1000) + 1, zmq.POLLOUT)
        while True:
            if interrupted is not None and interrupted():
                raise BusInterrupted(f"stopped waiting for {self.endpoint}")
            left = deadline - time.monotonic()
            wait_ms = int(left * 1000) + 1
            if left <= 0 or not self.sock.poll(min(wait_ms, slice_ms or wait_ms), zmq.POLLIN):
                if time.monotonic() >= deadline:
                    raise BusTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s")
                continue
            msg = self.channel.unpack_dealer(self.sock.recv_multipart())
            if msg is not None and getattr(msg.body, "request_id", None) == body.request_id:
                return msg

    def close(self) -> None:
        self.sock.close(0)
