"""A clock that moves only when a test moves it."""

from __future__ import annotations


class FakeClock:
    """Call it to read the time; set or add to `now` to move it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
