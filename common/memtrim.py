"""Giving freed heap memory back to the OS after a connection flood (glibc only).

libzmq allocates per connection (pipes, codec buffers, the frames it holds) from
glibc's malloc. When thousands of connections close, that memory is free but stays in
the process: glibc returns only the top of each heap, and after large frames its dynamic
mmap threshold has grown, so later large frames come from the heap too. Measured on the
supervisor: 2000 held connections took it from 38 to 85 MB and it stayed at 85 MB after
they closed; 80 connections pushing 500 KB frames peaked at 2 GB and kept 870 MB.
`malloc_trim(0)` releases every free page of every arena, so each listener's ZmtpWatch
asks for one once a burst of closed connections has settled (`Reclaimer`). Elsewhere
(macOS, musl) the release is a no-op that reports False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Callable

# After the last close: trim when the burst has settled, and again later, since the
# frames a closed connection held are freed only when its owner next touches the socket
# (libzmq ends a pipe in the owner's thread; a reader whose budget is dry is not reading).
TRIM_AFTER_S = (0.5, 2.0, 5.0)
CHURN_TRIM_S = 5.0  # closes that never settle (connect, drop, repeat): trim this often
CHURN_CLOSED = 256  # ... if this many connections closed since the last trim


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def release_freed_memory() -> bool:
    """Return free heap pages to the OS; True if glibc released any."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


class Reclaimer:
    """When to trim: at each of TRIM_AFTER_S after the last close (or every CHURN_TRIM_S
    under steady churn). Decisions take `now`; `release` does the work."""

    def __init__(self, release: Callable[[], bool] = release_freed_memory) -> None:
        self.release = release
        self.closes = 0  # connections closed since the last trim
        self.first_close = 0.0  # the first close since the last trim
        self.last_close = 0.0
        self.step = len(TRIM_AFTER_S)  # the next of TRIM_AFTER_S; all done: idle
        self.trims = 0

    def closed(self, now: float) -> None:
        if not self.closes:
            self.first_close = now
        self.closes += 1
        self.last_close = now
        self.step = 0

    def tick(self, now: float) -> float:
        """Trim if due; the next time a tick is wanted (inf: nothing pending)."""
        if self.step >= len(TRIM_AFTER_S):
            return math.inf
        settled = now >= self.last_close + TRIM_AFTER_S[self.step]
        churn = self.closes >= CHURN_CLOSED and now >= self.first_close + CHURN_TRIM_S
        if settled or churn:
            self.release()
            self.closes = 0
            self.trims += 1
            if settled:
                self.step += 1
            if self.step >= len(TRIM_AFTER_S):
                return math.inf
        return self.last_close + TRIM_AFTER_S[self.step]


# One per process: a trim is process-wide, whichever listener's connections closed.
RECLAIMER = Reclaimer()
