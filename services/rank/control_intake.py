"""The rank's control SUB (LEASE, SERVE, SHUTDOWN, CANCEL, CACHE_CLEAR from the supervisor):
which messages the rank believes, and when (docs/security.md).

    frames → right topic, this launch's control key, MAC, replay window, schema?
                                             else counted by the channel (a rejection)
           → this deployment and job?        else control.wrong_deployment
           → the supervisor proved itself on report?
                                             else held until it has
           → delivered

The supervisor publishes leases from the moment it launches the ranks, so a rank
usually hears one before its report handshake completes. Such a message passed every
check a message can pass on its own (only this launch's supervisor holds the control
key); what is missing is the session proof, which comes moments later. It is held, not
counted: a clean start rejects nothing. Only the latest of each kind is held: every kind
is re-sent until answered (leases periodically, serve until serving, cancels until
acked, shutdown and cache clears until done), so the latest is all a rank needs, and
the hold stays bounded (one per kind) however long the proof takes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from common.bus import Channel


class ControlIntake:
    def __init__(self, chan: Channel, topic: bytes, deployment_id: str, job_id: str,
                 drops: collections.Counter[str], *, verified: Callable[[], bool],
                 deliver: Callable[[Any], None]) -> None:
        self.chan, self.topic, self.drops = chan, topic, drops
        self.deployment_id, self.job_id = deployment_id, job_id
        self._verified, self._deliver = verified, deliver
        self._held: dict[type, Any] = {}  # kind -> latest body, in arrival order

    @property
    def held(self) -> int:
        return len(self._held)

    def on_frames(self, frames: list[bytes]) -> None:
        msg = self.chan.unpack_sub(frames, self.topic)
        if msg is None or not self._ours(msg.body):
            return
        if not self._verified():  # the supervisor has not proved itself yet
            self._held.pop(type(msg.body), None)  # re-inserted: arrival order
            self._held[type(msg.body)] = msg.body
            return
        self.release()  # anything held goes first: it arrived first
        self._deliver(msg.body)

    def release(self) -> None:
        """Deliver what was held, once the supervisor has proved itself."""
        if self._held and self._verified():
            held, self._held = self._held, {}
            for body in held.values():
                self._deliver(body)

    def _ours(self, body: Any) -> bool:
        ok = getattr(body, "deployment_id", self.deployment_id) == self.deployment_id \
            and getattr(body, "job_id", self.job_id) == self.job_id
        if not ok:
            self.drops["control.wrong_deployment"] += 1
        return ok
