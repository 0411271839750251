"""A follower's word to rank 0 about its disk tier (DISK_INDEX on the plan socket):
the entries its start-up scan verified, and later the keys whose write-through failed.
Rank 0 plans a LOAD only of what every rank verified, and drops a failed key on every
rank (services/rank/disk_plan.py). The I/O thread owns it: it sends the report until a
PING acknowledges its seq, and polls the tier for failed writes (a thread-safe queue of
keys), so a failure is reported even while the follower's main loop sleeps.
"""

from __future__ import annotations

from common.messages import DiskIndex
from services.rank.disk_tier import DiskEntry

DISK_FLUSH_S = 3.0  # at exit, pending writes get this long to land
RESEND_S = 1.0
MAX_FAILED = 4096  # keys per report; older unacknowledged ones are re-reported later


def boot_report(rank: int, verified: dict[str, DiskEntry], *, off: bool) -> DiskIndex:
    return DiskIndex(rank=rank, seq=1, verified=sorted(verified), off=off)


class DiskReporter:
    def __init__(self) -> None:
        self.report: DiskIndex | None = None  # the one being sent
        self.acked = 0
        self.sent_at = float("-inf")

    def due(self, now: float, boot: DiskIndex | None, tier) -> DiskIndex | None:
        """The report to send now, if any (boot: the start-up report, once set)."""
        if self.report is None:
            if boot is None:
                return None
            self.report = boot
        failed = tier.take_failed() if tier is not None else []
        if failed:
            r = self.report
            keys = [k for k in r.failed if k not in failed] + failed
            self.report = DiskIndex(rank=r.rank, seq=r.seq + 1, verified=r.verified,
                                    failed=keys[-MAX_FAILED:], off=r.off)
            self.sent_at = float("-inf")
        if self.report.seq <= self.acked or now - self.sent_at < RESEND_S:
            return None
        self.sent_at = now
        return self.report

    def ack(self, seq: int) -> None:
        """A PING says rank 0 took report `seq`: its failed keys are dealt with."""
        if seq > self.acked:
            self.acked = seq
            if self.report is not None and self.report.seq <= seq:
                self.report.failed = []
                self.report.verified = []
