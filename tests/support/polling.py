"""Polling with deadlines: call a predicate until it is truthy, fail naming what was
awaited. One loop for every test; the adapters elsewhere only fix argument order,
interval or exception type."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def _check(pred: Callable[[], Any], deadline: float, timeout: float, what: str,
           error: Callable[[str], BaseException]) -> Any:
    """One call of `pred`; past the deadline a falsy answer raises `error`."""
    value = pred()
    if not value and time.monotonic() >= deadline:
        raise error(f"timed out after {timeout:.1f}s waiting for {what}")
    return value


def poll_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05, *,
             error: Callable[[str], BaseException] = AssertionError) -> Any:
    """Call `pred` until it returns something truthy and return that. At the deadline
    raise `error(message)` (an exception class, or a factory taking the message)."""
    deadline = time.monotonic() + timeout
    while not (value := _check(pred, deadline, timeout, what, error)):
        time.sleep(interval)
    return value


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """`poll_for` with `what` first (the order the process and netns tests use)."""
    return poll_for(check, timeout, what, interval)


async def apoll_for(pred: Callable[[], Any], timeout: float, what: str,
                    interval: float = 0.01) -> Any:
    """`poll_for` in a coroutine: sleeps on the event loop between calls."""
    deadline = time.monotonic() + timeout
    while not (value := _check(pred, deadline, timeout, what, AssertionError)):
        await asyncio.sleep(interval)
    return value
