"""Session authentication on the rank's sockets (common/handshake.py, docs/security.md).
Runs inside the I/O thread; every check is a dict lookup or one HMAC.

    leader_gate   rank 0's plan ROUTER: the handshake responder for ranks 1..N-1; then
                  only an authenticated identity, speaking for its own rank, is let
                  through (PLAN_HELLO, PLAN_FETCH, PONG).
    InitiatorLink a DEALER's side (a follower's plan socket towards rank 0, every rank's
                  report socket towards the supervisor): HELLO until accepted, verify the
                  responder's proof before anything else from it is believed.
    ReportSession every rank's report DEALER: reports go out only once accepted; no
                  handshake within `auth_timeout_s` fails the rank closed. It knows
                  which supervisor process proved itself (`peer`, an `Origin`); when
                  another one's control turns up (a restarted supervisor, which binds
                  the same endpoints), `reauthenticate` runs the handshake again:
                  fresh nonces, the same routing identity (a DEALER presents it on every
                  reconnect). A re-handshake never fails the rank: the lease and the
                  adopt window decide (services/rank/watchdogs.py).
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common.bus import Channel
from common.envelope import Header, Message, Reason
from common.handshake import AuthError, Gate, Initiator, Responder, session_keys
from common.keys import LaunchKeys
from common.messages import AUTH_TO_INITIATOR, AuthChallenge
from common.rankspec import RankSpec

log = logging.getLogger("lockstep.rank.auth")
# HELLO re-sent until accepted, backing off: 0.5 s, then twice as long each time up to 4 s.
# A fixed 0.5 s piled HELLOs up in this DEALER's own pipe ahead of its proof while rank 0's
# ROUTER took one frame per connection per round from a flood of them.
HELLO_RESEND_S = 0.5
HELLO_RESEND_MAX_S = 4.0


def new_identity(rank: int) -> bytes:
    """A DEALER routing id nobody can guess, so none can squat it before we connect."""
    return f"r{rank}-{secrets.token_hex(8)}".encode()


@dataclass(frozen=True)
class Origin:
    """Which process signed a message: its sender and its process boot id. A Signer's
    boot is "<process boot id>.<suffix per Signer>" (common/envelope.py), so one
    supervisor process's control PUB and report ROUTER share it, and a restarted one
    differs."""

    sender: str
    boot: str

    @classmethod
    def of(cls, header: Header) -> Origin:
        return cls(header.sender, header.boot.partition(".")[0])

    def __str__(self) -> str:
        return f"{self.sender} (boot {self.boot})"


def leader_gate(spec: RankSpec, keys: LaunchKeys, chan: Channel, send) -> Gate:
    """Rank 0's plan ROUTER: responder for ranks 1..N-1."""
    responder = Responder("plan", spec.deployment_id, spec.job_id, range(1, spec.world_size),
                          lambda r: session_keys(keys, r))
    return Gate(chan, responder, send)


class InitiatorLink:
    def __init__(self, channel: str, spec: RankSpec, keys: LaunchKeys, chan: Channel,
                 identity: bytes, send, *, quiet: bool = False) -> None:
        up, down = session_keys(keys, spec.rank)
        self.name, self.quiet = channel, quiet  # quiet: the owner logs the acceptance
        self.chan, self._send = chan, send
        self.init = Initiator(channel, spec.deployment_id, spec.job_id, spec.rank, identity,
                              up, down)
        self.started_at = time.monotonic()
        self.accepted_at: float | None = None
        self._hello_at = 0.0
        self._hello_every = HELLO_RESEND_S

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
                        if not self.quiet:
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
            self._hello_at = now + self._hello_every
            self._hello_every = min(2 * self._hello_every, HELLO_RESEND_MAX_S)
            self._send(self.init.hello())
        return self._hello_at


class ReportSession:
    def __init__(self, spec: RankSpec, keys: LaunchKeys, chan: Channel, sock: zmq.Socket,
                 wire, *, on_fail: Callable[[str], None]) -> None:
        self.spec, self.keys, self.chan, self.sock, self.wire, self._on_fail = \
            spec, keys, chan, sock, wire, on_fail
        self.ident = new_identity(spec.rank)
        sock.setsockopt(zmq.IDENTITY, self.ident)
        sock.connect(spec.report_endpoint)
        self.link = self._new_link(quiet=False)
        self.drops: collections.Counter[str] = wire.drops
        self.peer: Origin | None = None  # the supervisor process that proved itself last
        self.proofs = 0  # handshakes in which a supervisor proved itself (start-up, re-auths)
        self.reauths = 0  # re-authentications completed (AUTH_OK after the first)
        self._renewing_at: float | None = None  # a re-handshake under way since
        self._accepted_once = False
        self._failed = False
        self._live = False
        # The report connection dropped (the supervisor process may be gone): nothing is
        # sent until its control shows it is the same one, or another proved itself.
        # Else what the rank sends meanwhile waits in the DEALER's pipe and reaches a
        # restarted supervisor, which refuses it (no session): noise in its counters.
        self.muted = False

    def _new_link(self, *, quiet: bool) -> InitiatorLink:
        return InitiatorLink("report", self.spec, self.keys, self.chan, self.ident,
                             lambda body: self.wire.send(self.sock, self.chan, body),
                             quiet=quiet)

    @property
    def peer_verified(self) -> bool:
        return self.link.peer_verified

    def send(self, body) -> None:
        if self.link.accepted and not self.muted:  # else the supervisor would refuse it
            self.wire.send(self.sock, self.chan, body)

    def disconnected(self) -> None:
        """The report connection dropped (a socket monitor saw it): hold reports, and drop
        what was sent between the drop and now (still queued in the DEALER's pipe: a
        restarted supervisor would refuse it) by disconnecting and connecting again."""
        if self.link.accepted and not self.muted:
            self.muted = True
            self.sock.disconnect(self.spec.report_endpoint)  # its pipe, queue and all
            self.sock.connect(self.spec.report_endpoint)
            log.info("report: connection to the supervisor dropped; reports held until it "
                     "or a restarted one is heard from")

    def heard(self, origin: Origin) -> None:
        """Control from `origin` was delivered: if it is the proven supervisor, it is still
        there (a dropped connection, not a restart): report again."""
        if self.muted and origin == self.peer and self.link.accepted:
            self.muted = False
            log.info("report: the supervisor %s is still there; reporting again", origin)

    def reauthenticate(self) -> None:
        """Control from another supervisor process passed this launch's key: a restarted
        supervisor (it read the launch secret from disk). Handshake again, with fresh
        nonces; until it proved itself, `peer` stays the old one and nothing is reported
        (its ROUTER would refuse it: it has no session for us). One handshake at a time."""
        if not self.link.accepted:
            return  # the start-up handshake, or a re-handshake, is still under way
        log.info("report: control from another supervisor process; authenticating again")
        self.link = self._new_link(quiet=True)
        self._renewing_at = time.monotonic()
        self._live = False

    def accepted_now(self) -> bool:
        """True once per handshake, right after the supervisor accepted us (the start-up
        one, then each re-authentication: `reauths` counts those)."""
        if self.link.accepted and not self._live:
            self._live = True
            if self._accepted_once and self._renewing_at is not None:
                self.reauths += 1
                log.info("report: re-authenticated with a restarted supervisor %s in %.0f ms",
                         self.peer, (time.monotonic() - self._renewing_at) * 1000)
            self._accepted_once = True
            self._renewing_at = None
            self.muted = False  # a supervisor proved itself: it has a session for us
            return True
        return False

    def on_frames(self, frames: list[bytes]) -> None:
        msg = self.chan.unpack_dealer(frames)
        if msg is None:
            return
        was = self.link.peer_verified
        if self.link.on_message(msg) is not None:
            self.drops["report.unexpected"] += 1  # the supervisor only answers the handshake
        if not was and self.link.peer_verified:  # its AUTH_CHALLENGE carried the proof
            self.peer = Origin.of(msg.header)
            self.proofs += 1

    def timers(self, now: float, rejects: Callable[[], dict]) -> float:
        """HELLO re-sends; fail closed if the start-up handshake never completes (a
        re-handshake does not: the lease and the adopt window decide)."""
        timeout = self.spec.settings.auth_timeout_s
        if not self._accepted_once and not self.link.accepted and not self._failed \
                and now - self.link.started_at > timeout:
            self._failed = True
            self._on_fail(f"no mutual authentication with the supervisor at "
                          f"{self.spec.report_endpoint} within {timeout:.0f}s (a stale launch "
                          f"secret?); rejections: {rejects()}")
        return self.link.timers(now)
