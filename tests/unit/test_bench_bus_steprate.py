"""bench.bus_steprate: the step's messages on both codecs, the judged arithmetic, what
`over_10pct` owns up to, and one short paced exchange with a real receiver process."""

from __future__ import annotations

import psutil
import pytest

from bench.bus import over_10pct
from bench.bus_children import plain_pack, plain_unpack
from bench.bus_steprate import (
    STREAMS,
    StepRate,
    batch_body,
    latencies_us,
    percentile,
    plan_body,
    summarize,
)
from common.bus import Channel
from common.envelope import Key
from common.messages import PLAN_TO_FOLLOWER, REQUESTS_OUT, Kind

KEY = Key.from_secret(b"k" * 32)


def test_step_messages_decode_on_both_paths_and_carry_their_step():
    plan, batch = plan_body(41), batch_body(41, 1.5)
    assert len(batch.chunks) == STREAMS == 8 and all(len(c.tokens) == 1 for c in batch.chunks)
    pln = Channel("t", "plan", sender="rank-0", send_key=KEY, accept=PLAN_TO_FOLLOWER)
    req = Channel("t", "requests", sender="rank-0", send_key=KEY, accept=REQUESTS_OUT)
    assert pln.unpack_dealer([pln.pack(plan)]).body == plan
    assert req.unpack_dealer([req.pack(batch)]).body == batch
    assert plain_unpack(plain_pack(plan), Kind.PLAN) == plan
    got = plain_unpack(plain_pack(batch), Kind.TOKENS_BATCH)
    assert got == batch and got.chunks[0].step == 41  # the receiver's message index


def test_percentile_is_nearest_rank_and_missing_messages_are_left_out():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == \
        (50.0, 99.0, 100.0)
    assert percentile([7.0], 99) == 7.0
    assert latencies_us([1000, 2000, 3000], [4000, 0, 5000]) == [3.0, 2.0]


def _trial(sender: float, receiver: float, p50: float) -> dict:
    lat = {"p50": p50, "p99": 2 * p50}
    return {"steps": 100, "sender_cpu_us_per_step": sender, "receiver_cpu_us_per_step": receiver,
            "sender_codec_us_per_step": sender / 2, "receiver_codec_us_per_step": receiver / 2,
            "plan_latency_us": lat, "batch_latency_us": lat}


def test_summarize_judges_paired_added_cpu_against_the_step_time():
    # At 250 steps/s a step is 4000 µs; the pairs add 300, 500 and 100 µs (median 300).
    trials = {"signed": [_trial(300, 300, 120), _trial(400, 400, 110), _trial(200, 200, 130)],
              "plain": [_trial(150, 150, 100), _trial(150, 150, 100), _trial(150, 150, 100)]}
    r = summarize(250, trials)
    assert r["step_ms"] == 4.0
    assert r["added_cpu_us_per_step"] == {"sender": 150, "receiver": 150, "total": 300}
    assert r["signing_overhead_pct_of_step"] == 7.5 and r["target_met"] is True
    assert r["rank0_overhead_pct_of_step"] == 3.75
    assert r["added_codec_us_per_step"]["total"] == 150
    assert r["latency_us"]["plan"]["added_p50_us"] == 20.0
    assert r["latency_us"]["plan"]["signed_over_plain_p50"] == 1.2
    # The same cost in a 2 ms step is 15% of it: not met.
    assert summarize(500, trials)["target_met"] is False


def test_the_added_cpu_is_the_median_of_back_to_back_pairs_not_of_medians():
    # Load drifts between pairs: paired differences 200, 50, 50 (median 50), while the
    # medians' difference (300 - 150) would say 150.
    trials = {"signed": [_trial(300, 0, 1), _trial(400, 0, 1), _trial(200, 0, 1)],
              "plain": [_trial(100, 0, 1), _trial(350, 0, 1), _trial(150, 0, 1)]}
    assert summarize(250, trials)["added_cpu_us_per_step"]["sender"] == 50


def test_over_10pct_names_every_figure_above_ten_percent_judged_or_not():
    slow = summarize(500, {"signed": [_trial(300, 300, 120)], "plain": [_trial(150, 150, 100)]})
    fine = summarize(250, {"signed": [_trial(151, 151, 100)], "plain": [_trial(150, 150, 100)]})
    result = {"rpc": {"signing_overhead_pct": 20.5}, "rpc_async": {"signing_overhead_pct": 3.0},
              "broadcast": {"signing_overhead_pct": 44.0},
              "step_rate": {"rates_steps_per_s": [250, 500], "250_per_s": fine,
                            "500_per_s": slow}}
    notes = over_10pct(result)
    assert [n.split(":")[0] for n in notes] == [
        "saturation rpc", "saturation broadcast", "at 500 steps/s", "at 500 steps/s",
        "at 500 steps/s", "at 500 steps/s"]
    assert sum("JUDGED" in n for n in notes) == 1


@pytest.mark.timeout(60)
def test_a_short_paced_exchange_with_a_real_receiver_loses_nothing():
    bench = StepRate(KEY)
    child = psutil.Process(bench.child.pid)
    try:
        got = [bench.trial(mode, 500, 0.1) for mode in ("signed", "plain")]
    finally:
        bench.close()
    for t in got:
        assert t["steps"] == 50 and t["rejected"] == 0
        assert t["missing"] == {"plan": 0, "batch": 0}
        assert t["sender_cpu_us_per_step"] > t["sender_codec_us_per_step"] > 0
        assert t["receiver_cpu_us_per_step"] > t["receiver_codec_us_per_step"] > 0
        assert t["plan_latency_us"]["p50"] > 0 and t["batch_latency_us"]["p50"] > 0
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
