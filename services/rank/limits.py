"""Keep the descriptor limit the launcher gave this rank.

`mlx_lm.utils` sets RLIMIT_NOFILE to (2048, 4096) when it is imported, hard limit
included (irreversible without CAP_SYS_RESOURCE). Rank 0 holds one descriptor per
connection to its listening sockets (plan, requests), so a flood of connections would
reach 2048 quickly and then starve everything else the rank opens (marker files, logs).
While the rank imports mlx_lm (once, in the main thread, before any other thread runs)
a call that would *lower* RLIMIT_NOFILE is skipped; anything else passes through.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Iterator

log = logging.getLogger("lockstep.rank.limits")


@contextlib.contextmanager
def keep_fd_limit() -> Iterator[None]:
    real = resource.setrlimit

    def guarded(which: int, limits: tuple[int, int]) -> None:
        if which == resource.RLIMIT_NOFILE:
            soft, hard = resource.getrlimit(which)
            if limits[0] < soft or limits[1] < hard:
                log.debug("kept RLIMIT_NOFILE %s (asked for %s)", (soft, hard), limits)
                return
        real(which, limits)

    resource.setrlimit = guarded
    try:
        yield
    finally:
        resource.setrlimit = real
