"""common.memtrim.Reclaimer: when freed memory is handed back after connections close
(pure decisions on `now`; the release itself is glibc's malloc_trim)."""

from __future__ import annotations

import math

from common import memtrim
from common.memtrim import CHURN_CLOSED, CHURN_TRIM_S, TRIM_AFTER_S, Reclaimer


def recl() -> tuple[Reclaimer, list[int]]:
    calls: list[int] = []
    return Reclaimer(lambda: bool(calls.append(1))), calls


def test_nothing_closed_nothing_to_do():
    r, calls = recl()
    assert r.tick(100.0) == math.inf and calls == []


def test_a_burst_is_trimmed_once_settled_and_again_later():
    r, calls = recl()
    for i in range(500):
        r.closed(10.0 + i * 0.001)
    last = 10.499
    assert r.tick(10.6) == last + TRIM_AFTER_S[0] and calls == []  # still closing
    for k, after in enumerate(TRIM_AFTER_S):
        nxt = r.tick(last + after)
        assert len(calls) == k + 1
        assert nxt == (last + TRIM_AFTER_S[k + 1] if k + 1 < len(TRIM_AFTER_S) else math.inf)
    assert r.tick(last + 100) == math.inf and len(calls) == len(TRIM_AFTER_S)


def test_a_new_close_starts_the_schedule_again():
    r, calls = recl()
    r.closed(0.0)
    r.tick(TRIM_AFTER_S[0])
    r.closed(1.0)
    assert r.tick(1.0 + TRIM_AFTER_S[0] - 0.01) == 1.0 + TRIM_AFTER_S[0]
    r.tick(1.0 + TRIM_AFTER_S[0])
    assert len(calls) == 2


def test_steady_churn_is_trimmed_at_a_bounded_rate():
    r, calls = recl()
    now = 100.0
    while now < 100.0 + 3 * CHURN_TRIM_S:  # a close every 1 ms, never settling
        r.closed(now)
        r.tick(now)
        now += 0.001
    assert 2 <= len(calls) <= 4  # about one per CHURN_TRIM_S, each after CHURN_CLOSED
    assert CHURN_CLOSED < CHURN_TRIM_S * 1000


def test_release_is_real_on_glibc_and_harmless_elsewhere():
    assert memtrim.release_freed_memory() in (True, False)
