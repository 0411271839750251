"""Bounded work for peers nobody has authenticated (DESIGN.md §3, docs/security.md).

A listening socket cannot refuse a connection, so it must make every unauthenticated
frame cheap and cap how many it looks at:

- `Budget`: a token bucket per socket, charged for every frame that was rejected or was
  part of a handshake (authenticated traffic is free). Big frames cost more (one token
  per started 64 KiB). When the bucket is empty the owner stops reading that socket
  until `resume_at()`; libzmq then holds at most RCVHWM frames per connection and
  pushes back on the sender over TCP, while ZeroMQ's fair queueing keeps handing the
  owner one frame per connection in turn — so a legitimate peer on the same socket
  waits at most about (flooding connections / rate) + one pause.
- `LogLimiter`: rejection log lines per socket are capped, then summarised, so a flood
  can fill neither the disk nor the CPU with logging.

Both are O(1) per frame and allocate nothing per frame.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_RATE = 2000.0  # pre-auth frames per second per socket
DEFAULT_BURST = 400.0
RESUME_TOKENS = 10.0  # a paused socket is read again once this many tokens are back
BYTES_PER_TOKEN = 65536


class Budget:
    def __init__(self, rate: float = DEFAULT_RATE, burst: float = DEFAULT_BURST, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("budget needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()
        self.charged = 0  # frames charged in total
        self.pauses = 0  # times the bucket ran dry
        self._dry = False

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def charge(self, nbytes: int = 0) -> None:
        """One unauthenticated frame of `nbytes` was looked at."""
        self.charged += 1
        self._tokens -= 1 + nbytes // BYTES_PER_TOKEN

    def exhausted(self, now: float | None = None) -> bool:
        if self._tokens >= 1:
            self._dry = False
            return False
        self._refill(self._clock() if now is None else now)
        dry = self._tokens < 1
        if dry and not self._dry:
            self.pauses += 1
        self._dry = dry
        return dry

    def resume_at(self, now: float | None = None) -> float:
        """When the socket may be read again (now, if tokens are left)."""
        now = self._clock() if now is None else now
        self._refill(now)
        if self._tokens >= 1:
            return now
        return now + (min(RESUME_TOKENS, self.burst) - self._tokens) / self.rate


class LogLimiter:
    """At most `lines` log lines per `period_s`; then one summary line per period."""

    def __init__(self, log: logging.Logger, lines: int = 10, period_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.lines = lines
        self.period_s = period_s
        self._clock = clock
        self._start = -period_s
        self._count = 0
        self.suppressed = 0

    def warning(self, fmt: str, *args: object) -> None:
        now = self._clock()
        if now - self._start >= self.period_s:
            if self.suppressed:
                self.log.warning("... %d more like these suppressed in the last %.0fs",
                                 self.suppressed, self.period_s)
            self._start, self._count, self.suppressed = now, 0, 0
        if self._count < self.lines:
            self._count += 1
            self.log.warning(fmt, *args, stacklevel=2)
        else:
            self.suppressed += 1
