"""Replay and time: the per-sender replay window (reordering, restarts, capacity) and the
freshness window of the header timestamp on a fake clock."""

from __future__ import annotations

import math

import pytest

from common import messages as m
from common.envelope import REPLAY_WINDOW, Reason, ReplayWindow, Signer
from common.messages import Kind
from common.schema import to_wire
from tests.support.clock import FakeClock
from tests.support.envelope import (
    KEY,
    NOW,
    SAMPLES,
    reject,
    sign_raw,
    signer,
    verifier,
)


def test_replay_is_rejected():
    v = verifier()
    frame = signer().encode(SAMPLES[Kind.CANCEL])
    v.decode(frame)
    assert reject(v, frame) is Reason.REPLAY
    assert reject(v, frame) is Reason.REPLAY
    assert v.counter.snapshot() == {"replay": 2}


def test_reordered_within_window_accepted_once():
    s = signer()
    v = verifier()
    frames = [s.encode(m.PlanFetch(i)) for i in range(64)]
    order = list(range(64))
    order = order[::2][::-1] + order[1::2]  # descending evens, then ascending odds
    got = [v.decode(frames[i]).body.from_seq for i in order]
    assert got == order
    for i in (0, 7, 63):
        assert reject(v, frames[i]) is Reason.REPLAY
    assert v.counter.snapshot() == {"replay": 3}


def test_sequence_older_than_window_is_replay():
    s = signer()
    v = verifier()
    v.decode(s.encode(m.PlanFetch(0), seq=REPLAY_WINDOW + 10))
    assert reject(v, s.encode(m.PlanFetch(0), seq=10)) is Reason.REPLAY  # never seen, too old
    assert v.decode(s.encode(m.PlanFetch(0), seq=11)).header.seq == 11  # just inside
    big_jump = s.encode(m.PlanFetch(0), seq=10 * REPLAY_WINDOW)
    assert v.decode(big_jump).header.seq == 10 * REPLAY_WINDOW
    assert reject(v, big_jump) is Reason.REPLAY


def test_new_signer_is_a_new_boot():
    v = verifier()
    first = signer("rank-0")
    for i in range(3):
        v.decode(first.encode(m.PlanFetch(i)))
    second = signer("rank-0")  # restarted sender: same name, seq restarts at 1
    assert second.boot != first.boot
    msg = v.decode(second.encode(m.PlanFetch(0)))
    assert (msg.header.seq, msg.header.boot) == (1, second.boot)
    assert reject(v, first.encode(m.PlanFetch(9), seq=2)) is Reason.REPLAY


def test_replay_window_forgets_oldest_sender_beyond_capacity():
    w = ReplayWindow(size=8, max_senders=2)
    assert w.check_and_record("a", "1", 5)
    assert w.check_and_record("b", "1", 5)
    assert w.check_and_record("c", "1", 5)  # evicts a
    assert not w.check_and_record("b", "1", 5)
    assert w.check_and_record("a", "1", 5)  # a was forgotten


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(-30.5, Reason.STALE), (-3600.0, Reason.STALE), (30.5, Reason.FUTURE), (86400.0, Reason.FUTURE),
     (-30.0, None), (30.0, None), (0.0, None)],
)
def test_stale_and_future_timestamps(offset, reason):
    clock = FakeClock(NOW)
    v = verifier(clock=clock)
    frame = signer().encode(SAMPLES[Kind.LEASE], ts=NOW + offset)
    if reason is None:
        assert v.decode(frame).header.ts == NOW + offset
    else:
        assert reject(v, frame) is reason
        assert v.counter.snapshot() == {reason.value: 1}


def test_clock_moves_the_window():
    clock = FakeClock(NOW)
    v = verifier(clock=clock)
    s = Signer(KEY, "tester", clock=clock)
    early = s.encode(SAMPLES[Kind.LEASE])
    clock.now += 31
    assert reject(v, early) is Reason.STALE
    assert v.decode(s.encode(SAMPLES[Kind.LEASE])).header.ts == NOW + 31


@pytest.mark.parametrize(("ts", "reason"), [(math.nan, Reason.STALE), (math.inf, Reason.FUTURE),
                                             (-math.inf, Reason.STALE), (2**64 - 1, Reason.FUTURE)])
def test_non_finite_or_huge_timestamp(ts, reason):
    assert reject(verifier(), sign_raw(to_wire(SAMPLES[Kind.ABORT]), ts=ts)) is reason
