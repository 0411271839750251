"""Abort-all's zero-active evidence per rank (services/supervisor/broadcast.py): telemetry
after the abort with nothing active, or the rank observed gone. A rank that merely went
quiet proves nothing."""

from __future__ import annotations

import subprocess
import sys

from services.supervisor.broadcast import zero_evidence
from services.supervisor.deployment import RankState

EPOCH = 7


def _rank(**kw) -> RankState:
    return RankState(rank=1, host="local", **kw)


def test_telemetry_after_the_abort_with_nothing_active_is_evidence():
    assert zero_evidence(_rank(active=0, telemetry_rx=5.0, cancel_epoch=EPOCH), EPOCH)
    assert zero_evidence(_rank(active=0, telemetry_rx=5.0, acked_epoch=EPOCH, acked_at=4.0), EPOCH)


def test_active_requests_stale_telemetry_or_silence_are_not():
    assert not zero_evidence(_rank(active=2, telemetry_rx=5.0, cancel_epoch=EPOCH), EPOCH)
    assert not zero_evidence(_rank(active=0, telemetry_rx=0.0), EPOCH)  # never reported
    assert not zero_evidence(_rank(active=0, telemetry_rx=3.0, acked_epoch=EPOCH,
                                   acked_at=4.0), EPOCH)  # telemetry older than the ack
    assert not zero_evidence(_rank(active=0, telemetry_rx=5.0, cancel_epoch=EPOCH - 1), EPOCH)


def test_a_rank_observed_gone_runs_nothing():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    # its last telemetry said 3 active and it never acked: gone is the evidence
    assert zero_evidence(_rank(active=3, telemetry_rx=5.0, popen=dead), EPOCH)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not zero_evidence(_rank(active=3, telemetry_rx=5.0, popen=alive), EPOCH)
    finally:
        alive.kill()
        alive.wait(30)
