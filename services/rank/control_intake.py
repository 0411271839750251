"""The rank's control SUB (LEASE, SERVE, SHUTDOWN, CANCEL, CACHE_CLEAR from the supervisor):
which messages the rank believes, and when (docs/security.md).

    frames → right topic, this launch's control key, MAC, replay window, schema?
                                             else counted by the channel (a rejection)
           → this deployment and job?        else control.wrong_deployment
           → from the supervisor process that proved itself on report?
                                             deliver
           → from one that was replaced (an old supervisor)?
                                             else control.old_supervisor
           → held until a supervisor proves itself; if one already had: another
             supervisor process (a restarted one), so the report session handshakes
             again (services.rank.auth.ReportSession.reauthenticate)

The supervisor publishes leases from the moment it launches the ranks, so a rank
usually hears one before its report handshake completes. Such a message passed every
check a message can pass on its own (only this launch's supervisor holds the control
key); what is missing is the session proof, which comes moments later. It is held, not
counted: a clean start rejects nothing. Only the latest of each kind is held: every kind
is re-sent until answered (leases periodically, serve until serving, cancels until
acked, shutdown and cache clears until done), so the latest is all a rank needs, and
the hold stays bounded (one per kind) however long the proof takes.

Adoption (docs/rank.md): a supervisor restarted after a crash binds the same endpoints
and reads the launch secret from disk, so its control passes the key; but it is a new
process (another `Origin`: sender and boot id), and the rank believes it only once it
proved itself on report like the first one did. From then on the replaced supervisor's
control, still in flight, is dropped and counted. Each completed proof (`session.proofs`)
settles what is held: the proven supervisor's messages are delivered, any other's dropped.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

from common.bus import Channel
from services.rank.auth import Origin

REFUSED_MAX = 16  # origins remembered as replaced (each needs this launch's key)


class Supervisor(Protocol):
    """What the intake asks of the report session (services.rank.auth.ReportSession)."""

    peer: Origin | None  # the supervisor process that proved itself last, if any
    proofs: int  # how many times one did (a change: settle what is held)

    def reauthenticate(self) -> None: ...

    def heard(self, origin: Origin) -> None: ...  # control from `origin` was delivered


class ControlIntake:
    def __init__(self, chan: Channel, topic: bytes, deployment_id: str, job_id: str,
                 drops: collections.Counter[str], *, session: Supervisor,
                 deliver: Callable[[Any], None]) -> None:
        self.chan, self.topic, self.drops = chan, topic, drops
        self.deployment_id, self.job_id = deployment_id, job_id
        self.session, self._deliver = session, deliver
        self._held: dict[type, tuple[Origin, Any]] = {}  # kind -> latest, in arrival order
        self._proofs = 0  # session.proofs when what was held was last settled
        self._peer: Origin | None = None  # session.peer then
        self._refused: collections.OrderedDict[Origin, None] = collections.OrderedDict()

    @property
    def held(self) -> int:
        return len(self._held)

    def on_frames(self, frames: list[bytes]) -> None:
        msg = self.chan.unpack_sub(frames, self.topic)
        if msg is None or not self._ours(msg.body):
            return
        origin = Origin.of(msg.header)
        self.release()  # anything held goes first: it arrived first
        if self._peer is not None and origin == self._peer:
            self.session.heard(origin)
            self._deliver(msg.body)
        elif origin in self._refused:
            self.drops["control.old_supervisor"] += 1
        else:
            self._held.pop(type(msg.body), None)  # re-inserted: arrival order
            self._held[type(msg.body)] = (origin, msg.body)
            if self._peer is not None:  # another supervisor process: a restarted one?
                self.session.reauthenticate()

    def release(self) -> None:
        """After a supervisor proved itself (start-up or again): believe it from now on,
        deliver what it sent meanwhile, drop (and count) any other's."""
        if self.session.proofs == self._proofs:
            return
        self._proofs, peer = self.session.proofs, self.session.peer
        if self._peer is not None and self._peer != peer:
            self._refuse(self._peer)  # replaced: its control is no longer believed
        self._peer = peer
        self._refused.pop(peer, None)
        held, self._held = self._held, {}
        for origin, body in held.values():
            if origin == peer:
                self._deliver(body)
            else:
                self._refuse(origin)
                self.drops["control.old_supervisor"] += 1

    def _refuse(self, origin: Origin) -> None:
        self._refused[origin] = None
        while len(self._refused) > REFUSED_MAX:
            self._refused.popitem(last=False)

    def _ours(self, body: Any) -> bool:
        ok = getattr(body, "deployment_id", self.deployment_id) == self.deployment_id \
            and getattr(body, "job_id", self.job_id) == self.job_id
        if not ok:
            self.drops["control.wrong_deployment"] += 1
        return ok
