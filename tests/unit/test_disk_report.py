"""A follower's DISK_INDEX for rank 0 (services/rank/disk_report.py): re-sent until a
PING acknowledges it; failed writes polled from the tier and reported once each."""

from __future__ import annotations

from services.rank.disk_report import RESEND_S, DiskReporter, boot_report
from services.rank.disk_tier import DiskEntry


class Tier:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def take_failed(self) -> list[str]:
        out, self.failed = self.failed, []
        return out


def test_the_boot_report_is_resent_until_acknowledged():
    r, tier = DiskReporter(), Tier()
    assert r.due(0.0, None, tier) is None  # nothing until the scan is done
    boot = boot_report(1, {"k" * 32: DiskEntry("k" * 32, [1, 2], 10, 0.0)}, off=False)
    first = r.due(0.0, boot, tier)
    assert (first.rank, first.seq, first.verified) == (1, 1, ["k" * 32])
    assert r.due(0.1, boot, tier) is None  # not before RESEND_S
    assert r.due(RESEND_S, boot, tier) is first  # re-sent
    r.ack(1)
    assert r.due(10.0, boot, tier) is None


def test_failed_writes_get_a_new_seq_and_are_reported_until_acknowledged():
    r, tier = DiskReporter(), Tier()
    boot = boot_report(2, {}, off=False)
    r.due(0.0, boot, tier)
    r.ack(1)
    tier.failed = ["a" * 32]
    rep = r.due(0.5, boot, tier)
    assert (rep.seq, rep.failed) == (2, ["a" * 32])
    tier.failed = ["b" * 32]
    rep = r.due(0.6, boot, tier)  # a new failure is sent at once, with the unacked one
    assert (rep.seq, rep.failed) == (3, ["a" * 32, "b" * 32])
    r.ack(3)
    assert r.due(5.0, boot, tier) is None and r.report.failed == []
