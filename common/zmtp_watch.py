"""Counting what libzmq drops before any frame reaches us.

A peer that sends raw bytes (a port scan, an HTTP probe, random garbage), or connects
and never speaks, fails the ZeroMQ (ZMTP) handshake inside libzmq: the connection is
closed and the application never sees a frame, so the envelope's rejection counters
cannot see it either. A socket monitor can: every connection whose handshake fails (and
which libzmq then closes) is counted as `no_zmtp` on the listener's reject counter,
like any other rejection, and logged (rate-limited). Nothing is charged to the socket's
admission budget: the work was libzmq's, and legitimate frames must not wait for it.

Some garbage never reaches a failure event: libzmq takes a first byte other than 0xFF
(or a 10th byte with its low bit clear) for an unversioned ZMTP 1.0 peer, and when the
bytes then fail its 1.0 framing it closes the connection with no handshake event at all
(about 1 in 100 random 64-byte payloads). Those are counted by elimination: libzmq
resolves every handshake within HANDSHAKE_IVL (success, failure, or such a close), so a
connection accepted longer ago than that which neither succeeded nor failed was closed
silently (`tick` settles it). So is a peer that closes before its greeting is done, even
a real ZeroMQ one: it never became a ZeroMQ session either. The events carry no
connection id, so the count is a lower bound that is exact once no connection is younger
than the window, and never more: `tick` counts nothing while events are still queued
(an outcome not yet read would look like a silence).

The monitor also tracks how many connections a listener has open, for status and logs.
Capping that number is beyond libzmq's API (see docs/security.md). Each close is noted
with the process's memory reclaimer (common/memtrim.py): the owner calls `tick(now)`
when it is due, and once a burst of closes settles, freed heap goes back to the OS.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.envelope import Reason, RejectCounter
from common.frame_budget import LogLimiter
from common.memtrim import RECLAIMER, Reclaimer

log = logging.getLogger("lockstep.zmtp")

# libzmq's handshake events carry no connection id (a failure's value is an errno, a
# success's is 0), so the failure events themselves are what is counted: garbage, a
# protocol error, a handshake timeout (HANDSHAKE_IVL: the silent peer). A peer that
# sends part of a valid greeting and then closes emits none: `tick` counts it.
FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed or timed out",
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error in the handshake",
          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused"}
EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
SETTLE_SLACK_S = 1.0  # beyond HANDSHAKE_IVL: the monitor's own delivery, a busy owner
BACKLOG_RETRY_S = 0.05  # tick again this soon when events were still queued


class ZmtpWatch:
    """Feed it the monitor socket's frames (`on_frames`); it counts `no_zmtp` on `counter`
    once per connection whose ZMTP handshake failed (then libzmq closes it), or that
    libzmq closed without a handshake outcome (counted by `tick`, see the module doc)."""

    def __init__(self, sock: zmq.Socket, counter: RejectCounter,
                 reclaimer: Reclaimer = RECLAIMER) -> None:
        # The monitor socket has the listener's flavour (asyncio or not) and context.
        self.monitor = sock.get_monitor_socket(EVENTS)
        self.counter = counter
        self.reclaimer = reclaimer
        self._log = LogLimiter(log)
        self.open = 0
        self.failed = 0
        self.accepted = 0
        self.succeeded = 0
        self.silent = 0  # closed with no handshake outcome, counted so far
        ivl_ms = sock.getsockopt(zmq.HANDSHAKE_IVL)  # 0: no handshake deadline, no bound
        self.window = ivl_ms / 1000 + SETTLE_SLACK_S if ivl_ms > 0 else math.inf
        self._young: deque[float] = deque()  # when each accept within the window was seen

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            ev = parse_monitor_message(frames)
        except Exception:  # noqa: BLE001 - libzmq's own socket; never expected
            return
        event, value = ev["event"], ev["value"]
        if event == zmq.EVENT_ACCEPTED:
            self.open += 1
            self.accepted += 1
            self._young.append(time.monotonic())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded += 1
        elif event == zmq.EVENT_DISCONNECTED:
            self.open = max(0, self.open - 1)
            self.reclaimer.closed(time.monotonic())
        elif event in FAILED:
            self.failed += 1
            self.counter.add(Reason.NO_ZMTP)
            self._log.warning("%s/%s rejected a connection: %s (errno %s)",
                              self.counter.service, self.counter.socket, FAILED[event], value)

    def drain(self) -> None:
        """Handle every event already queued (for loops that poll the monitor)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_frames(frames)

    def tick(self, now: float) -> float:
        """Count connections closed with no handshake outcome, and release memory freed by
        closed connections, if either is due; when to tick next (inf: nothing pending).
        While monitor events are still queued nothing is counted (an outcome not yet read
        would look like a silence), and the monitor is only looked at when a count is due."""
        young = self._young
        while young and young[0] <= now - self.window:
            young.popleft()
        # Every accept older than the window has its outcome; those without one were
        # silent. Younger ones may still be handshaking: left out, so never an overcount.
        silent = self.accepted - self.succeeded - self.failed - len(young)
        if silent > self.silent and self._backlog():
            # An owner behind on its monitor: an accept it already saw may have its
            # outcome queued, and would be taken for a silence. Count once caught up.
            return min(now + BACKLOG_RETRY_S, self.reclaimer.tick(now))
        if silent > self.silent:
            for _ in range(silent - self.silent):
                self.counter.add(Reason.NO_ZMTP)
            self._log.warning("%s/%s: %d connection(s) closed by libzmq without a ZMTP "
                              "handshake", self.counter.service, self.counter.socket,
                              silent - self.silent)
            self.silent = silent
        settle = young[0] + self.window if young else math.inf
        return min(settle, self.reclaimer.tick(now))

    def _backlog(self) -> bool:
        try:
            return bool(self.monitor.get(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:  # closed (shutdown): nothing more will be read
            return False

    def close(self) -> None:
        if not self.monitor.closed:
            self.monitor.close(linger=0)
