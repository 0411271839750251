"""Is rank 0 still there? The gateway's own answer, from its request link to rank 0,
without waiting for the supervisor (which learns it one hop away and then tells us).

Two signals, both from libzmq on the gateway's DEALER:
- the socket monitor's EVENT_DISCONNECTED: rank 0's process died (the kernel closes its
  socket, so a SIGKILL shows within milliseconds), or libzmq dropped the connection;
- ZMTP heartbeats (HEARTBEAT_IVL / HEARTBEAT_TIMEOUT, set before the DEALER connects):
  a host that vanished (power, a partition) sends no FIN; libzmq's PING then gets no
  PONG within the timeout and it drops the connection: the same event. Rank 0's ROUTER
  answers PINGs in libzmq's I/O thread, so a rank busy in a long step (GIL held) still
  answers; only a process that stopped running for HEARTBEAT_TIMEOUT_MS is lost.

`LinkState` decides, pure: monitor events and `now` in, a typed `Link` out. `LinkWatch`
feeds it from the monitor socket and calls `on_lost(reason)` once per loss. A loss is
final for its Backend (request_channel.py): the deployment is not routed to until the
supervisor reports it again after the link came back, or reports a new job (cluster_view.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("lockstep.gateway.rank_link")

HEARTBEAT_IVL_MS = 1000  # a PING when the link was quiet this long
HEARTBEAT_TIMEOUT_MS = 10_000  # no traffic (PONG included) this long: the link is dropped
# Options for the request DEALER, applied before it connects (libzmq copies them then).
DEALER_OPTIONS: dict[int, int] = {zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS,
                                  zmq.HEARTBEAT_TIMEOUT: HEARTBEAT_TIMEOUT_MS}
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Link(enum.Enum):
    CONNECTING = "connecting"  # no handshake seen yet (the monitor may start after it)
    UP = "up"
    LOST = "lost"  # the connection to rank 0 closed


@dataclass
class LinkState:
    """The link to one rank 0, from its monitor's events. `lost_at`/`up_at` are in the
    caller's clock (monotonic in LinkWatch)."""

    endpoint: str
    link: Link = Link.CONNECTING
    up_at: float | None = None
    lost_at: float | None = None
    reason: str | None = None

    def observe(self, event: int, now: float) -> bool:
        """Apply one monitor event; True iff it is a loss (the caller fails its streams)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.link, self.up_at = Link.UP, now
            return False
        if event == zmq.EVENT_DISCONNECTED and self.link is not Link.LOST:
            self.link, self.lost_at = Link.LOST, now
            self.reason = (f"the connection to rank 0 ({self.endpoint}) closed: its process "
                           "exited, or its host stopped answering heartbeats")
            return True
        return False

    def back_since_loss(self) -> bool:
        """A handshake after the last loss: rank 0 answers on this endpoint again."""
        return (self.lost_at is not None and self.up_at is not None
                and self.up_at > self.lost_at and self.link is Link.UP)


class LinkWatch:
    """Reads the DEALER's socket monitor on the event loop; `on_lost` once per loss."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str,
                 on_lost: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = LinkState(endpoint)
        self.monitor = sock.get_monitor_socket(EVENTS)
        self._sock = sock
        self._on_lost = on_lost
        self._clock = clock
        self._task: asyncio.Task | None = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                frames = await self.monitor.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # noqa: BLE001 - libzmq's own socket; never expected
                continue
            if self.state.observe(event, self._clock()):
                log.warning("%s", self.state.reason)
                self._on_lost(self.state.reason or "rank 0 lost")

    def close(self) -> None:
        """Before the DEALER closes: stop reading, then drop the monitor."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
