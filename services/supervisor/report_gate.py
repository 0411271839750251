"""Admission on the supervisor's report ROUTER (docs/security.md).

    frame → [identity, envelope]?             else bad_frames
          → at most REPORT_MAX bytes?             else oversize (dropped unread)
          → magic (fixed-width prefix)?          else too_short / bad_magic
          → key id (same prefix) names a live launch?
                                              a launch that has ended: retired_key
                                              no launch at all:        unknown_key
          → that launch's channel verifies it (MAC first, then replay window, schema)
          → AUTH_HELLO / AUTH_PROOF: that launch's handshake responder answers
          → anything else: only from an identity that completed the handshake, and only
            for its own rank (unauthenticated / wrong_peer)

Everything before the MAC is a dict lookup on 8 bytes; the handshake is two HMACs per
message and holds no state until a proof verifies (common/handshake.py's cookies). Every rejection and every handshake
message is charged to the socket's `Budget`; the read loop sleeps when it runs dry.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.bus import Channel
from common.envelope import MAGIC, PREFIX, Key, Message, Reason, RejectCounter
from common.frame_budget import Budget
from common.handshake import Gate, Responder, session_keys

log = logging.getLogger("lockstep.supervisor.report_gate")
RETIRED_MAX = 256  # key ids of ended launches remembered, to name their frames
REPORT_MAX = 256 * 1024  # RANK_READY / TELEMETRY / CANCEL_ACK are small


@dataclass
class LaunchRoute:
    channel: Channel
    route: Any  # the Deployment
    gate: Gate


class ReportAdmission:
    def __init__(self, send: Callable[[bytes, bytes], None], *,
                 budget: Budget | None = None) -> None:
        self._send = send  # (identity, signed frame), non-blocking
        self.rejects = RejectCounter("supervisor", "report")
        self.budget = budget or Budget()
        self.routes: dict[bytes, LaunchRoute] = {}
        self.retired: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: Key, channel: Channel, route: Any) -> None:
        """Accept reports of one launch: `route` is its Deployment (deployment_id, job_id,
        world_size and keys, a common.keys.LaunchKeys)."""
        channel.budget = self.budget
        channel.verifier.max_size = channel.max_size = REPORT_MAX
        keys = route.keys
        responder = Responder("report", route.deployment_id, route.job_id,
                              range(route.world_size), lambda r: session_keys(keys, r))
        gate = Gate(channel, responder,
                    lambda ident, body: self._send(ident, channel.pack(body)))
        self.routes[key.key_id] = LaunchRoute(channel, route, gate)
        self.retired.pop(key.key_id, None)

    def drop(self, key: Key) -> None:
        if self.routes.pop(key.key_id, None) is not None:
            self.retired[key.key_id] = None
            while len(self.retired) > RETIRED_MAX:
                self.retired.popitem(last=False)

    def _reject(self, reason: Reason, nbytes: int = 0) -> None:
        self.rejects.add(reason)
        self.budget.charge(nbytes)

    def admit(self, frames: list[bytes]) -> tuple[Any, Message] | None:
        """(deployment, message) from an authenticated rank; None otherwise (handshake
        answered, or the frame counted under its reason)."""
        if len(frames) != 2:
            self._reject(Reason.BAD_FRAMES)
            return None
        ident, data = frames
        if len(data) > REPORT_MAX:
            self._reject(Reason.OVERSIZE, len(data))  # dropped unread
            return None
        if len(data) < PREFIX.size:
            self._reject(Reason.TOO_SHORT)
            return None
        magic, _version, key_id, _ = PREFIX.unpack_from(data)
        if magic != MAGIC:
            self._reject(Reason.BAD_MAGIC, len(data))
            return None
        entry = self.routes.get(key_id)
        if entry is None:
            self._reject(Reason.RETIRED_KEY if key_id in self.retired else Reason.UNKNOWN_KEY,
                         len(data))
            return None
        msg = entry.channel.unpack(data)
        if msg is None:
            return None
        got = entry.gate.admit_message(ident, msg)
        return None if got is None else (entry.route, got[1])
