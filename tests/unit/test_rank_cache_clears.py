"""Rank 0's ledger of admin cache clears (services/rank/cache_clears.py): each clear id
reaches the main thread once, every re-send of an answered one gets the same answer, and
with the cache off the I/O thread answers at once."""

from __future__ import annotations

from common.messages import CacheClear, CacheCleared
from services.rank.cache_clears import ANSWERED_KEPT, ClearLedger, answers
from services.rank.outbox import Report


def test_a_clear_reaches_the_main_thread_once_and_its_resends_get_the_same_answer():
    led = ClearLedger("d", enabled=True)
    assert led.on_request(CacheClear("d", 1), step=5) == (True, None)
    assert led.on_request(CacheClear("d", 1), step=6) == (False, None)  # still pending
    [report] = answers([1], "d", 9)  # the Leader, behind the plan carrying the CLEAR
    assert report == Report(CacheCleared("d", 1, 0, 9))
    led.on_answer(report.body)  # the I/O thread, as it sends it
    assert led.on_request(CacheClear("d", 1), step=20) == (False, CacheCleared("d", 1, 0, 9))
    assert led.on_request(CacheClear("d", 2), step=20) == (True, None)  # a new clear


def test_with_the_cache_off_the_io_thread_answers_at_once():
    led = ClearLedger("d", enabled=False)
    assert led.on_request(CacheClear("d", 7), step=3) == (False, CacheCleared("d", 7, 0, 3))
    assert led.on_request(CacheClear("d", 7), step=8) == (False, CacheCleared("d", 7, 0, 3))


def test_answers_kept_are_bounded():
    led = ClearLedger("d", enabled=False)
    for i in range(ANSWERED_KEPT + 10):
        led.on_request(CacheClear("d", i), step=i)
    assert len(led.answered) == ANSWERED_KEPT and 0 not in led.answered
