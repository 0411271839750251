"""Reading the rank's sockets without letting anyone unauthenticated stall the I/O thread.

Each socket is read in bursts. A listening socket (rank 0's plan and requests ROUTERs)
carries an admission budget (common.frame_budget.Budget, on its Channel): every rejected
or handshake frame is charged, authenticated traffic is free. When the budget runs dry
the socket is taken out of the poller until `resume_at`, so the thread sleeps in
`poll` (GIL released) instead of spinning on garbage; libzmq holds at most RCVHWM frames
per connection meanwhile and pushes back on the sender. `between()` (the outbox: step
plans, tokens) runs every few frames, so a burst of input never delays a plan by more
than a few frames' work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from common.frame_budget import Budget

BURST = 256  # frames read from one socket per poll round
BETWEEN_EVERY = 16  # frames between two looks at the outbox
Handler = Callable[[list[bytes]], object]


class Intake:
    def __init__(self, poller: zmq.Poller, *, burst: int = BURST) -> None:
        self.poller = poller
        self.burst = burst
        self.handlers: dict[zmq.Socket, tuple[Handler, Budget | None]] = {}
        self.paused: dict[zmq.Socket, float] = {}  # socket -> monotonic resume time
        self.pauses = 0

    def add(self, sock: zmq.Socket, handler: Handler, budget: Budget | None = None) -> None:
        self.handlers[sock] = (handler, budget)
        self.poller.register(sock, zmq.POLLIN)

    def next_resume(self) -> float:
        """Resume what is due; return when the next paused socket is due (inf if none)."""
        if not self.paused:
            return float("inf")
        now = time.monotonic()
        for sock, at in list(self.paused.items()):
            if at <= now:
                del self.paused[sock]
                self.poller.modify(sock, zmq.POLLIN)
        return min(self.paused.values(), default=float("inf"))

    def read(self, ready: dict, between: Callable[[], bool]) -> bool:
        """Handle what is ready; True if `between()` asked to stop."""
        for sock, (handler, budget) in self.handlers.items():
            if sock not in ready or sock in self.paused:
                continue
            for i in range(1, self.burst + 1):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handler(frames)
                if budget is not None and budget.exhausted():
                    self.paused[sock] = budget.resume_at()
                    self.poller.modify(sock, 0)
                    self.pauses += 1
                    break
                if i % BETWEEN_EVERY == 0 and between():
                    return True
        return False
