"""ZeroMQ helpers shared by every service: signed channels, socket settings,
sequence-checked subscriptions and acknowledged broadcasts (the RPC clients: common/rpc_client.py).

Frame shapes (anything else is rejected as `bad_frames`):
  ROUTER receives [identity, envelope]; sends [identity, envelope]
  DEALER sends / receives [envelope]
  PUB sends [topic, envelope]; SUB receives the same and checks the topic exactly
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.envelope import (
    DEFAULT_MAX_SIZE,
    Key,
    Message,
    Reason,
    RejectCounter,
    Rejected,
    Signer,
    Verifier,
    random_id,
)
from common.frame_budget import Budget, LogLimiter
from common.messages import Kind

log = logging.getLogger("lockstep.bus")


class BusTimeout(Exception):
    """A request-reply call passed its deadline without a reply."""


class BusInterrupted(BusTimeout):
    """The caller gave up waiting (its `interrupted()` turned true) before a reply came.
    A timeout as far as the socket goes: a late reply may still arrive."""


def configure(sock: zmq.Socket, *, max_size: int = DEFAULT_MAX_SIZE, hwm: int = 10000) -> zmq.Socket:
    """Size cap enforced by libzmq itself (oversize peers are disconnected unread)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_size)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


# Listening sockets (anyone who can reach the port can connect): docs/security.md.
LISTENER_BUFFER = 1024 * 1024  # bytes of frames libzmq may hold per connection, unread
LISTENER_RCVBUF = 256 * 1024  # SO_RCVBUF: what the kernel buffers per connection
HANDSHAKE_IVL_MS = 5000  # a connection that never completes the ZMTP greeting is dropped
PUB_MAX_SIZE = 1024  # what a PUB receives is subscriptions: topic prefixes only


def listener_rcvhwm(max_size: int) -> int:
    """Frames libzmq holds per connection while the owner is not reading: as many as fit
    in LISTENER_BUFFER, at least 2 (RCVHWM counts frames, not bytes)."""
    return max(2, LISTENER_BUFFER // max_size)


def configure_listener(sock: zmq.Socket, *, max_size: int, sndhwm: int = 10000) -> zmq.Socket:
    """A socket peers connect to. libzmq itself enforces the channel's size cap
    (`max_size`): a bigger frame makes it drop the connection, nothing read or
    delivered. What one connection can make it buffer while the owner does not read
    (its admission budget is dry) is then bounded: (RCVHWM + 2) frames of at most
    `max_size` (held, being decoded, announced) plus SO_RCVBUF in the kernel, on top of
    libzmq's ~25 KB of pipes and codec buffers per connection."""
    configure(sock, max_size=max_size, hwm=sndhwm)
    sock.setsockopt(zmq.RCVHWM, listener_rcvhwm(max_size))
    sock.setsockopt(zmq.RCVBUF, LISTENER_RCVBUF)  # kernel memory per connection, bounded
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    return sock


class Channel:
    """Signing and verification for one socket, with counted, logged rejections."""

    def __init__(
        self,
        service: str,
        socket_name: str,
        *,
        sender: str,
        send_key: Key,
        recv_keys: Iterable[Key] | None = None,
        accept: Iterable[Kind] = (),
        max_size: int = DEFAULT_MAX_SIZE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.socket_name = socket_name
        self.signer = Signer(send_key, sender, clock=clock)
        self.rejects = RejectCounter(service, socket_name)
        self.verifier = Verifier(recv_keys or [send_key], accept, self.rejects,
                                 max_size=max_size, clock=clock)
        self.max_size = max_size
        self.budget: Budget | None = None  # set on listening sockets (common.frame_budget)
        self._log = LogLimiter(log)

    def pack(self, body: Any) -> bytes:
        return self.signer.encode(body)

    def unpack(self, payload: Any) -> Message | None:
        try:
            return self.verifier.decode(payload)
        except Rejected as exc:
            if self.budget is not None:
                self.budget.charge(len(payload) if isinstance(payload, bytes) else 0)
            self._log.warning("%s/%s rejected a message: %s", self.service, self.socket_name, exc)
            return None

    def reject(self, reason: Reason, detail: str = "", nbytes: int = 0) -> None:
        """Count (and charge, and log, rate-limited) a rejection decided above the
        envelope: handshake failures, unauthenticated or wrong peers."""
        self.rejects.add(reason)
        if self.budget is not None:
            self.budget.charge(nbytes)
        self._log.warning("%s/%s rejected a message: %s%s", self.service, self.socket_name,
                          reason.value, f": {detail}" if detail else "")

    def charge(self, nbytes: int = 0) -> None:
        """Pre-authentication work that was not a rejection (a handshake message)."""
        if self.budget is not None:
            self.budget.charge(nbytes)

    def reject_frames(self, what: str) -> None:
        self.rejects.add(Reason.BAD_FRAMES)
        if self.budget is not None:
            self.budget.charge()
        self._log.warning("%s/%s rejected frames: %s", self.service, self.socket_name, what)

    # Frame layouts --------------------------------------------------------------

    def unpack_router(self, frames: list[bytes]) -> tuple[bytes, Message] | None:
        if len(frames) != 2:
            self.reject_frames(f"{len(frames)} frames on ROUTER")
            return None
        msg = self.unpack(frames[1])
        return None if msg is None else (frames[0], msg)

    def unpack_dealer(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 1:
            self.reject_frames(f"{len(frames)} frames on DEALER")
            return None
        return self.unpack(frames[0])

    def unpack_sub(self, frames: list[bytes], topic: bytes) -> Message | None:
        if len(frames) != 2 or frames[0] != topic:
            self.reject_frames("wrong topic or frame count on SUB")
            return None
        return self.unpack(frames[1])


@dataclass
class GapTracker:
    """Detects lost PUB/SUB messages from each publisher's per-socket sequence."""

    on_gap: Callable[[str, int, int], None] | None = None
    last: dict[tuple[str, str], int] = field(default_factory=dict)
    gaps: int = 0

    def observe(self, msg: Message) -> bool:
        """Record a message; True if it follows a gap from the same publisher."""
        key = (msg.header.sender, msg.header.boot)
        prev = self.last.get(key)
        self.last[key] = max(prev or 0, msg.header.seq)
        if prev is not None and msg.header.seq > prev + 1:
            self.gaps += 1
            if self.on_gap:
                self.on_gap(msg.header.sender, prev, msg.header.seq)
            return True
        return False


@dataclass
class BroadcastResult:
    acked: dict[str, Any]
    missing: list[str]
    sends: int


class AckCollector:
    """Re-sends a broadcast until every named peer acked or the deadline passed.

    `publish` sends the message once; acks arrive elsewhere (a report socket) and are
    fed in with `ack(peer, evidence)`. Peers declared dead can be dropped with `forget`.
    """

    def __init__(self, peers: Iterable[str], publish: Callable[[], Any]) -> None:
        self.pending = set(peers)
        self.acked: dict[str, Any] = {}
        self._publish = publish
        self._event = asyncio.Event()
        self.sends = 0
        if not self.pending:
            self._event.set()

    def ack(self, peer: str, evidence: Any = None) -> None:
        if peer in self.pending:
            self.pending.discard(peer)
            self.acked[peer] = evidence
            if not self.pending:
                self._event.set()

    def forget(self, peer: str) -> None:
        self.pending.discard(peer)
        if not self.pending:
            self._event.set()

    async def run(self, *, deadline_s: float, resend_s: float = 0.25) -> BroadcastResult:
        end = time.monotonic() + deadline_s
        while self.pending:
            res = self._publish()
            if asyncio.iscoroutine(res):
                await res
            self.sends += 1
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._event.wait(), min(resend_s, left))
            except asyncio.TimeoutError:
                if time.monotonic() >= end:
                    break  # no re-send once the deadline has passed
        return BroadcastResult(dict(self.acked), sorted(self.pending), self.sends)


async def wait_subscribed(
    publish: Callable[[], Any],
    peers: Iterable[str],
    confirmations: Callable[[], Awaitable[str | None]],
    *,
    deadline_s: float,
    resend_s: float = 0.1,
) -> BroadcastResult:
    """Slow-joiner handshake (DESIGN.md §2): a subscriber counts as joined only once it
    has confirmed receiving a message. Re-publish a hello until every peer confirmed.

    `publish()` sends one hello on the PUB socket (may be async); `confirmations()`
    awaits the next confirmation (e.g. from a ROUTER the subscribers' DEALERs answer
    on) and returns the confirming peer's name, or None for anything to ignore.
    Raises `BusTimeout` naming every peer that did not confirm by the deadline.
    """
    collector = AckCollector(peers, publish)

    async def pump() -> None:
        while collector.pending:
            peer = await confirmations()
            if peer is not None:
                collector.ack(peer)

    task = asyncio.ensure_future(pump())
    try:
        result = await collector.run(deadline_s=deadline_s, resend_s=resend_s)
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # re-raises what broke `confirmations`, if anything did
    if result.missing:
        raise BusTimeout(f"subscribers did not confirm within {deadline_s:.1f}s: "
                         + ", ".join(result.missing))
    return result


def new_request_id() -> str:
    return random_id("r-")
