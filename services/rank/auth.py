"""Session authentication on the rank's sockets (common/handshake.py, docs/security.md).
Runs inside the I/O thread; every check is a dict lookup or one HMAC.

    leader_gate   rank 0's plan ROUTER: the handshake responder for ranks 1..N-1; then
                  only an authenticated identity, speaking for its own rank, is let
                  through (PLAN_HELLO, PLAN_FETCH, PONG).
    InitiatorLink a DEALER's side (a follower's plan socket towards rank 0, every rank's
                  report socket towards the supervisor): HELLO until accepted, verify the
                  responder's proof before anything else from it is believed.
    ReportSession every rank's report DEALER: reports go out only once accepted; no
                  handshake within `auth_timeout_s` fails the rank closed.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import Callable

import zmq

from common.bus import Channel
from common.envelope import Message, Reason
from common.handshake import AuthError, Gate, Initiator, Responder, session_keys
from common.keys import LaunchKeys
from common.messages import AUTH_TO_INITIATOR, AuthChallenge
from common.rankspec import RankSpec

log = logging.getLogger("lockstep.rank.auth")
HELLO_RESEND_S = 0.5


def new_identity(rank: int) -> bytes:
    """A DEALER routing id nobody can guess, so none can squat it before we connect."""
    return f"r{rank}-{secrets.token_hex(8)}".encode()


def leader_gate(spec: RankSpec, keys: LaunchKeys, chan: Channel, send) -> Gate:
    """Rank 0's plan ROUTER: responder for ranks 1..N-1."""
    responder = Responder("plan", spec.deployment_id, spec.job_id, range(1, spec.world_size),
                          lambda r: session_keys(keys, r), on_drop=chan.reject)
    return Gate(chan, responder, send)


class InitiatorLink:
    def __init__(self, channel: str, spec: RankSpec, keys: LaunchKeys, chan: Channel,
                 identity: bytes, send) -> None:
        up, down = session_keys(keys, spec.rank)
        self.name = channel
        self.chan, self._send = chan, send
        self.init = Initiator(channel, spec.deployment_id, spec.job_id, spec.rank, identity,
                              up, down)
        self.started_at = time.monotonic()
        self.accepted_at: float | None = None
        self._hello_at = 0.0

    @property
    def peer_verified(self) -> bool:
        return self.init.peer_verified

    @property
    def accepted(self) -> bool:
        return self.init.accepted

    def on_message(self, msg: Message) -> Message | None:
        """Handshake replies are consumed here; anything else is returned only once the
        peer has proved itself (else counted `unauthenticated`)."""
        if msg.kind in AUTH_TO_INITIATOR:
            try:
                if isinstance(msg.body, AuthChallenge):
                    self._send(self.init.on_challenge(msg.body))
                else:
                    self.init.on_ok(msg.body)
                    if self.accepted_at is None:
                        self.accepted_at = time.monotonic()
                        log.info("%s: authenticated both ways in %.0f ms", self.name,
                                 (self.accepted_at - self.started_at) * 1000)
            except AuthError as exc:
                self.chan.reject(exc.reason, exc.detail)
            return None
        if not self.init.peer_verified:
            self.chan.reject(Reason.UNAUTHENTICATED, msg.kind.value)
            return None
        return msg

    def timers(self, now: float) -> float:
        """Send (or re-send) HELLO until accepted; when to be called next."""
        if self.init.accepted:
            return float("inf")
        if now >= self._hello_at:
            self._hello_at = now + HELLO_RESEND_S
            self._send(self.init.hello())
        return self._hello_at


class ReportSession:
    def __init__(self, spec: RankSpec, keys: LaunchKeys, chan: Channel, sock: zmq.Socket,
                 wire, *, on_fail: Callable[[str], None]) -> None:
        self.spec, self.chan, self.sock, self.wire, self._on_fail = \
            spec, chan, sock, wire, on_fail
        ident = new_identity(spec.rank)
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.connect(spec.report_endpoint)
        self.link = InitiatorLink("report", spec, keys, chan, ident,
                                  lambda body: wire.send(sock, chan, body))
        self.drops: collections.Counter[str] = wire.drops
        self._failed = False
        self._live = False

    @property
    def peer_verified(self) -> bool:
        return self.link.peer_verified

    def send(self, body) -> None:
        if self.link.accepted:  # before that the supervisor would refuse it anyway
            self.wire.send(self.sock, self.chan, body)

    def accepted_now(self) -> bool:
        """True once, right after the supervisor accepted us."""
        if self.link.accepted and not self._live:
            self._live = True
            return True
        return False

    def on_frames(self, frames: list[bytes]) -> None:
        msg = self.chan.unpack_dealer(frames)
        if msg is not None and self.link.on_message(msg) is not None:
            self.drops["report.unexpected"] += 1  # the supervisor only answers the handshake

    def timers(self, now: float, rejects: Callable[[], dict]) -> float:
        """HELLO re-sends; fail closed if the handshake never completes."""
        timeout = self.spec.settings.auth_timeout_s
        if not self.link.accepted and not self._failed and now - self.link.started_at > timeout:
            self._failed = True
            self._on_fail(f"no mutual authentication with the supervisor at "
                          f"{self.spec.report_endpoint} within {timeout:.0f}s (a stale launch "
                          f"secret?); rejections: {rejects()}")
        return self.link.timers(now)
