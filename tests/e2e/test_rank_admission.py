"""Rank 0's bound on open requests (RankSettings.max_open_requests), on a real
`python -m services.rank` process with the embedded tiny model: beyond the bound a
GENERATE is refused at once, in-band, with a typed code; once a request leaves, a new
one is admitted again."""

from __future__ import annotations

import pytest

from common.messages import ErrorCode
from tests.e2e.rank_harness import Deployment

BOUND = 3
LONG = 400  # at 0.02 s a step, ≥ 8 s: still running while we act
SLOW = {"LOCKSTEP_TEST_STEP_DELAY_S": "0.02"}


@pytest.mark.timeout(150)
def test_rank0_refuses_beyond_its_bound_in_band_and_admits_again(tmp_path):
    with Deployment(tmp_path, mode="single", settings={"max_open_requests": BOUND},
                    env=SLOW) as d:
        held = [d.submit([1, 2, 3 + i], LONG) for i in range(BOUND)]
        extra = [d.submit([4, 5, 6 + i], LONG) for i in range(2)]
        for rid in extra:
            r = d.result(rid, timeout=10)
            assert (r.finish_reason, r.tokens, len(r.chunks)) == ("error", [], 1)
            assert r.chunks[0].error_code == ErrorCode.OVERLOADED
            assert "open requests" in r.error  # text for people; the code is what counts
        # Refused while the admitted ones were still running: none of them has ended.
        with d.stub.cv:
            assert not any(d.stub.ended[h].is_set() for h in held)
        for h in held:
            d.wait_tokens(h, 1)  # admitted means served: each one streams
        active = set(d.stats().active_ids)
        assert set(held) <= active and not set(extra) & active
        # One leaves: exactly one more fits.
        d.abort(held[0])
        assert d.result(held[0]).finish_reason == "abort"
        fits = d.submit([7, 8, 9], LONG)
        d.wait_tokens(fits, 1)
        over = d.result(d.submit([7, 8, 10], 4), timeout=10)
        assert (over.finish_reason, over.chunks[-1].error_code) == ("error", ErrorCode.OVERLOADED)
        for rid in (*held[1:], fits):
            d.abort(rid)
            assert d.result(rid).finish_reason == "abort"
        # Empty again: requests are served to the end.
        done = [d.submit([1, 2, 3], 6) for _ in range(BOUND)]
        assert all(d.result(r).finish_reason in ("length", "stop") for r in done)


@pytest.mark.timeout(150)
def test_a_waiting_request_gets_rank_0s_heartbeat_until_its_first_token(tmp_path):
    """One slot (max_batch 1), taken by a long request: the next one waits in rank 0's
    queue, and rank 0 says so about once a second (Tokens.waiting, no tokens: what keeps
    the gateway's read timeout for a stopped model, not a long queue). Once it runs, the
    heartbeats stop and its tokens come as ever."""
    with Deployment(tmp_path, mode="single", settings={"max_batch": 1}, env=SLOW) as d:
        first = d.submit([1, 2, 3], LONG)
        d.wait_tokens(first, 1)
        queued = d.submit([4, 5, 6], 8)
        d.wait(lambda: d.stub.heartbeats[queued] >= 3, 20, "three heartbeats of the queued")
        assert not d.chunks(queued)  # no tokens yet: it waits
        assert d.stub.heartbeats[first] == 0  # the running one streams instead
        d.abort(first)
        r = d.result(queued)
        assert (r.finish_reason, len(r.tokens)) == ("length", 8), r
        beats = d.stub.heartbeats[queued]
        assert d.result(first).finish_reason == "abort"
        assert d.stub.heartbeats[queued] == beats  # none after it ended
