"""`lockstep up`'s redeploy budget: a rate, not a lifetime count (issue 44).

At most `limit` redeploys within any `window_s` seconds (`--restarts`, `--restart-window`),
as systemd's start limit per interval: faults hours apart never add up. Consecutive
redeploys inside the window are spaced by a backoff that doubles from `backoff_s` up to
`backoff_max_s` (Kubernetes' crash-loop backoff), counted from the previous redeploy, so
a deployment that keeps dying is not restarted in a tight loop while the first one after
a quiet spell is at once (streams are waiting to resume on it).

Past the rate `up` does not exit: it keeps the gateway, supervisor and reaper running and
waits for an operator's deploy (services/up/run.py). Decisions take `now` (monotonic
seconds) so they are tested with a fake clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Redeploy:
    delay_s: float  # wait this long first (the backoff); 0 = at once
    used: int  # redeploys within the window, this one included


@dataclass(frozen=True)
class Exhausted:
    used: int  # redeploys within the window already
    window_s: float

    def reason(self) -> str:
        return (f"restarts exhausted: {self.used} redeploy(s) in the last "
                f"{self.window_s:g}s (--restarts {self.used} --restart-window {self.window_s:g})")


class RestartBudget:
    def __init__(self, limit: int, window_s: float, backoff_s: float,
                 backoff_max_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._at: deque[float] = deque()  # when each redeploy inside the window began

    def _prune(self, now: float) -> None:
        while self._at and now - self._at[0] >= self.window_s:
            self._at.popleft()

    def decide(self, now: float) -> Redeploy | Exhausted:
        """What to do about a deployment that failed at `now`."""
        self._prune(now)
        recent = len(self._at)
        if recent >= self.limit:
            return Exhausted(recent, self.window_s)
        if not recent:
            return Redeploy(0.0, 1)
        backoff = min(self.backoff_s * 2 ** (recent - 1), self.backoff_max_s)
        return Redeploy(max(0.0, backoff - (now - self._at[-1])), recent + 1)

    def record(self, now: float) -> None:
        """A redeploy begins at `now`."""
        self._prune(now)
        self._at.append(now)

    def left(self, now: float) -> int:
        self._prune(now)
        return max(0, self.limit - len(self._at))
