"""Counting what libzmq drops before any frame reaches us.

A peer that sends raw bytes (a port scan, an HTTP probe, random garbage), or connects
and never speaks, fails the ZeroMQ (ZMTP) handshake inside libzmq: the connection is
closed and the application never sees a frame, so the envelope's rejection counters
cannot see it either. A socket monitor can: every connection whose handshake fails (and
which libzmq then closes) is counted as `no_zmtp` on the listener's reject counter,
like any other rejection, and logged (rate-limited). Nothing is charged to the socket's
admission budget: the work was libzmq's, and legitimate frames must not wait for it.

The monitor also tracks how many connections a listener has open, for status and logs.
Capping that number is beyond libzmq's API (see docs/security.md). Each close is noted
with the process's memory reclaimer (common/memtrim.py): the owner calls `tick(now)`
when it is due, and once a burst of closes settles, freed heap goes back to the OS.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.envelope import Reason, RejectCounter
from common.frame_budget import LogLimiter
from common.memtrim import RECLAIMER, Reclaimer

log = logging.getLogger("lockstep.zmtp")

# libzmq's handshake events carry no connection id (a failure's value is an errno, a
# success's is 0), so the failure events themselves are what is counted: garbage, a
# protocol error, a handshake timeout (HANDSHAKE_IVL: the silent peer). A peer that
# sends part of a valid greeting and then closes emits no failure event: not counted.
FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed or timed out",
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error in the handshake",
          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused"}
EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class ZmtpWatch:
    """Feed it the monitor socket's frames (`on_frames`); it counts `no_zmtp` on `counter`
    once per connection whose ZMTP handshake failed (then libzmq closes it)."""

    def __init__(self, sock: zmq.Socket, counter: RejectCounter,
                 reclaimer: Reclaimer = RECLAIMER) -> None:
        # The monitor socket has the listener's flavour (asyncio or not) and context.
        self.monitor = sock.get_monitor_socket(EVENTS)
        self.counter = counter
        self.reclaimer = reclaimer
        self._log = LogLimiter(log)
        self.open = 0
        self.failed = 0

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            ev = parse_monitor_message(frames)
        except Exception:  # noqa: BLE001 - libzmq's own socket; never expected
            return
        event, value = ev["event"], ev["value"]
        if event == zmq.EVENT_ACCEPTED:
            self.open += 1
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
        """Release memory freed by closed connections if that is due; when to tick next
        (inf: nothing pending)."""
        return self.reclaimer.tick(now)

    def close(self) -> None:
        if not self.monitor.closed:
            self.monitor.close(linger=0)
