"""Request work that can take time, off the event loop, a few at a time.

Parsing a large body, validating it, rendering the chat template and tokenizing are
CPU-bound; on the loop they would stall every other request and stream. They run on a
small pool of its own (`prepare_threads` workers): at most that many at once, whatever
the HTTP concurrency, so N concurrent huge prompts cost the memory of `prepare_threads`
of them (the rest wait, holding only their bodies, already capped by max_body_bytes).
A body up to INLINE_BYTES is parsed on the loop: its cost is bounded by its size.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
INLINE_BYTES = 16 * 1024


class PreparePool:
    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gw-prepare")

    async def run(self, fn: Callable[..., T], *args, **kw) -> T:
        """fn(*args) in the pool. A caller cancelled while it waits for a worker takes
        its work out of the queue; one cancelled while its work runs leaves it running
        (a thread cannot be interrupted) and the pool still bounds it."""
        call = functools.partial(fn, *args, **kw)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def parse(self, size: int, fn: Callable[..., T], *args, **kw) -> T:
        """fn(*args) inline for a body of at most INLINE_BYTES, else in the pool."""
        if size <= INLINE_BYTES:
            return fn(*args, **kw)
        return await self.run(fn, *args, **kw)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
