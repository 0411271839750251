"""What every way out of a rank shares: MLX memory given back, the kernel's last-resort
alarm, logs flushed. Used by RankRuntime.exit / hard_exit (services/rank/runtime.py)."""

from __future__ import annotations

import logging
import math
import signal
import sys

import mlx.core as mx

# A rank's exit codes (the supervisor reads them from the marker and the process status).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SIGNAL_HATCH = 3  # not gone within signal_clear_timeout after SIGTERM or shutdown


def release_memory() -> bool:
    """Give MLX's memory back before leaving: no wired limit, no buffer cache. Not
    while another thread is inside an MLX step: clear_cache then blocks, holding the
    GIL (measured with a ring peer stopped), and the whole process freezes."""
    try:
        if hasattr(mx, "set_wired_limit"):
            mx.set_wired_limit(0)
        mx.clear_cache()
        return True
    except Exception:  # noqa: BLE001 - set_wired_limit raises without Metal
        try:
            mx.clear_cache()
            return True
        except Exception:  # noqa: BLE001
            return False


def kernel_alarm(seconds: float) -> None:
    """(Re)arm alarm(2): SIGALRM, left at its default action, ends the process then,
    whatever any thread is doing. Any thread may call it; the earliest deadline wins."""
    s = max(1, math.ceil(seconds))
    left = signal.alarm(s)
    if 0 < left < s:
        signal.alarm(left)


def cache_memory() -> int:
    try:
        return int(mx.get_cache_memory())
    except Exception:  # noqa: BLE001
        return 0


def flush_logs() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
