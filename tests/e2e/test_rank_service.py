"""The rank service end to end: real `python -m services.rank` processes on MLX's ring
backend over loopback (TP=2, PP=2) and the 1-rank path, with the embedded tiny model,
driven by tests/e2e/rank_harness.py playing supervisor and gateway."""

from __future__ import annotations

import os
import secrets
import signal
import time

import psutil
import pytest
import zmq

from common import messages as m
from common.bus import Channel, configure
from common.envelope import Key, Signer
from tests.e2e.rank_harness import Deployment, model_dir, poll_until

# Different prompt lengths and completion lengths, served concurrently.
PROMPTS = [
    ([5, 6, 7], 12),
    ([11, 300, 42, 7, 99, 1000, 3, 250, 18], 20),
    ([int(7 + 13 * i) % 1100 + 3 for i in range(17)], 7),
    ([int(3 + 29 * i) % 1100 + 3 for i in range(40)], 30),
]
LONG = 400  # max_tokens of requests that must still be running when we act on them


@pytest.fixture(scope="module")
def greedy():
    """Greedy tokens from mlx-lm in this process (no OpenBLAS preload, no bus)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir()))

    def run(prompt: list[int], n: int) -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]

    return run


@pytest.fixture(scope="module")
def reference(greedy) -> list[list[int]]:
    return [greedy(p, n) for p, n in PROMPTS]


def _deploy(tmp_path_factory, mode: str, **kw):
    d = Deployment(tmp_path_factory.mktemp(mode), mode=mode, **kw)
    d.start()
    return d


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = _deploy(tmp_path_factory, "single")
    yield d
    d.teardown()


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    d = _deploy(tmp_path_factory, "tp")
    yield d
    d.teardown()


@pytest.fixture(scope="module")
def pp(tmp_path_factory):
    d = _deploy(tmp_path_factory, "pp")
    yield d
    d.teardown()


@pytest.fixture
def deployment(request):
    return request.getfixturevalue(request.param)


def run_concurrently(d: Deployment, prompts=PROMPTS) -> list[list[int]]:
    rids = [d.submit(p, n) for p, n in prompts]
    results = [d.result(r) for r in rids]
    assert [r.finish_reason for r in results] == ["length"] * len(prompts)
    d.last_rids = rids
    return [r.tokens for r in results]


def removal(d: Deployment, rank: int, rid: str) -> dict:
    """The one record of `rid` on `rank` (a follower may write it a moment after rank 0
    streamed the end)."""
    recs = poll_until(lambda: [r for r in d.removals(rank) if r["request_id"] == rid], 10,
                      f"rank {rank}'s record of {rid}")
    assert len(recs) == 1, (rank, rid, recs)
    return recs[0]


# -- equivalence -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_single_rank_matches_mlx_lm_greedy(single, reference):
    # The rank runs with OpenBLAS preloaded (when present); the reference without.
    for (prompt, n), want in zip(PROMPTS, reference, strict=True):
        r = single.generate(prompt, n)
        assert (r.tokens, r.finish_reason) == (want, "length")
        assert r.model_ttft_ms is not None and r.model_ttft_ms > 0
        assert len(r.token_times) == n and r.token_times == sorted(r.token_times)
    assert run_concurrently(single) == reference
    # A client stop token ends the request at its first occurrence, and is not emitted.
    stop = reference[3][5]
    r = single.generate(*PROMPTS[3], stop_token_ids=[stop])
    assert (r.tokens, r.finish_reason) == (reference[3][: reference[3].index(stop)], "stop")
    # Bad requests are answered with an error, not dropped, and change nothing.
    for bad in ([], [10**6], [-1]):
        e = single.generate(bad, 4)
        assert e.finish_reason == "error" and e.error and e.tokens == []
    assert single.generate(*PROMPTS[0]).tokens == reference[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["tp", "pp"], indirect=True)
def test_sharded_matches_single_rank(deployment, single, reference):
    assert run_concurrently(single) == reference
    assert run_concurrently(deployment) == reference
    rids = list(deployment.last_rids)
    for (prompt, n), want in zip(PROMPTS[:2], reference[:2], strict=True):
        r = deployment.generate(prompt, n)
        assert r.tokens == want
        rids.append(r.request_id)
    # Every rank recorded the same completions, under the same uids, at the same steps.
    for rid in rids:
        mine, theirs = removal(deployment, 0, rid), removal(deployment, 1, rid)
        assert {k: mine[k] for k in ("uid", "step", "reason", "tokens_sha")} == \
            {k: theirs[k] for k in ("uid", "step", "reason", "tokens_sha")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["tp", "pp"], indirect=True)
def test_seeded_sampling_is_identical_on_every_rank(deployment):
    prompt = PROMPTS[1][0]
    a = deployment.generate(prompt, 24, temperature=0.9, top_p=0.95, seed=1234)
    b = deployment.generate(prompt, 24, temperature=0.9, top_p=0.95, seed=1234)
    c = deployment.generate(prompt, 24, temperature=0.9, top_p=0.95, seed=99)
    # In a batch with greedy requests alongside: still the same tokens.
    g = deployment.submit(PROMPTS[3][0], 30)
    d = deployment.generate(prompt, 24, temperature=0.9, top_p=0.95, seed=1234)
    deployment.result(g)
    assert a.tokens == b.tokens == d.tokens and len(a.tokens) == 24
    assert c.tokens != a.tokens
    for res in (a, b, c, d):
        shas = {removal(deployment, r, res.request_id)["tokens_sha"] for r in (0, 1)}
        assert shas == {res.digest}


# -- abort -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["single", "tp"], indirect=True)
def test_abort_mid_decode_removes_at_the_same_step_everywhere(deployment, reference):
    d = deployment
    victim = d.submit([9, 8, 7, 6], LONG)
    others = [d.submit(p, n) for p, n in PROMPTS[1:3]]
    d.wait_tokens(victim, 5)
    d.abort(victim)
    r = d.result(victim)
    assert r.finish_reason == "abort" and 5 <= len(r.tokens) < LONG
    # The others complete unchanged: identical to an undisturbed (single request) run.
    assert [d.result(o).tokens for o in others] == reference[1:3]
    recs = [removal(d, rank, victim) for rank in range(d.world)]
    assert {x["reason"] for x in recs} == {"abort"}
    assert len({(x["step"], x["uid"], x["tokens_sha"], x["n_tokens"]) for x in recs}) == 1
    assert recs[0]["tokens_sha"] == r.digest and recs[0]["n_tokens"] == len(r.tokens)
    # An abort for something unknown or already finished changes nothing.
    d.abort(victim)
    d.abort("no-such-request")
    assert d.generate(*PROMPTS[0]).tokens == reference[0]


# -- prefill scheduling ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_long_prompt_prefills_between_the_running_streams_tokens(tp, greedy):
    """A prompt over `prefill_long_prompt` (2048) arriving while streams decode is
    prefilled in the small chunks rank 0 sizes (services/rank/prefill_policy.py), which
    every rank applies alike: the streams keep emitting meanwhile (at full 512-token
    chunks they would get 4 tokens in), and its own tokens are mlx-lm's greedy ones."""
    long_prompt = [5 + (7 * i * i + 3 * i) % 1000 for i in range(2300)]
    want = greedy(long_prompt, 3)
    runs = [tp.submit(p, LONG) for p, _ in PROMPTS[:2]]
    for rid in runs:
        tp.wait_tokens(rid, 2)
    arrived = time.time()  # rank 0 stamps tokens with this host's wall clock
    r = tp.result(tp.submit(long_prompt, 3), timeout=150)
    assert (r.tokens, r.finish_reason) == (want, "length")
    for rid in runs:  # both, before any assertion: the module's next test shares `tp`
        tp.abort(rid)
    # At full 512-token chunks the prompt takes ceil(2300 / 512) = 5 steps, so a stream
    # gets at most 5 tokens in; rank 0's small chunks give it several times that (11-17
    # seen, the fewer with the machine saturated by the suite's other worker).
    full_chunk_steps = -(-len(long_prompt) // 512)
    for rid in runs:
        times = tp.result(rid).token_times
        during = [t for t in times if arrived < t < r.token_times[0]]
        assert len(during) > full_chunk_steps + 3, (len(during), len(times))


# -- cancel broadcasts -----------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("deployment", ["single", "tp"], indirect=True)
def test_cancel_broadcast_applied_and_acked_once(deployment, reference):
    d = deployment
    ranks = range(d.world)
    # scope all
    x, y = d.submit([1, 2, 3], LONG), d.submit([4, 5, 6, 7], LONG)
    d.wait_tokens(x, 3)
    d.wait_tokens(y, 3)
    e1 = d.cancel("all")
    acks = d.wait_acks(e1)
    assert len({a.step_applied for a in acks.values()}) == 1
    assert all(set(a.cancelled) == {x, y} for a in acks.values())
    assert d.result(x).finish_reason == "abort" and d.result(y).finish_reason == "abort"
    for rid in (x, y):
        recs = [removal(d, rank, rid) for rank in ranks]
        assert {(r["reason"], r["step"]) for r in recs} == {("cancel", acks[0].step_applied)}
    # scope requests
    p, q = d.submit([1, 2, 3], LONG), d.submit(*PROMPTS[3])
    d.wait_tokens(p, 3)
    e2 = d.cancel("requests", [p])
    acks2 = d.wait_acks(e2)
    assert all(a.cancelled == [p] for a in acks2.values())
    assert len({a.step_applied for a in acks2.values()}) == 1
    assert d.result(p).finish_reason == "abort"
    assert d.result(q).tokens == reference[3]
    # A replayed epoch and an older one change nothing (they are only re-acked).
    for rank in ranks:
        removal(d, rank, q)  # every rank has recorded everything so far
    before = [len(d.removals(rank)) for rank in ranks]
    r = d.submit(*PROMPTS[3])
    d.wait_tokens(r, 2)
    d.publish_once(m.Cancel(d.deployment_id, e2, "requests", [r], "replay"))
    d.publish_once(m.Cancel(d.deployment_id, e1, "all", [], "older"))
    res = d.result(r)
    assert (res.finish_reason, res.tokens) == ("length", reference[3])
    for rank, n in zip(ranks, before, strict=True):
        removal(d, rank, r)
        new = d.removals(rank)[n:]
        assert [(x["request_id"], x["reason"]) for x in new] == [(r, "length")]
        assert d.fresh_telemetry(rank).cancel_epoch == e2
    assert d.acks(e1) == acks and d.acks(e2) == acks2  # re-acks carry the same evidence
    # A cancel with nothing in the batch is still applied (advance=False) and acked.
    e3 = d.cancel("all")
    assert len({a.step_applied for a in d.wait_acks(e3).values()}) == 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["single", "tp"])
def test_restarted_rank_treats_existing_epoch_as_watermark(tmp_path, mode):
    # single: the epoch comes in the spec (cancel_epoch_floor); tp: in the first LEASE.
    kw = {"cancel_epoch_floor": 7} if mode == "single" else {"lease_epoch": 7}
    slow = {"LOCKSTEP_TEST_STEP_DELAY_S": "0.01"}  # ≥ 4 s for a LONG request
    with Deployment(tmp_path, mode=mode, env=slow, **kw) as d:
        r = d.submit([1, 2, 3], LONG)
        d.wait_tokens(r, 2)
        d.cancel("all", epoch=7, resend_s=1.0)  # the old epoch, re-sent after a restart
        for k in range(d.world):  # every rank saw it and set it aside ...
            poll_until(lambda k=k: d.telemetry(k).rejects.get("control.cancel_watermark"), 10,
                       f"rank {k} to ignore epoch 7")
        assert r in d.stats().active_ids  # ... while the request kept running
        assert d.acks(7) == {} and not [x for x in d.removals(0) if x["request_id"] == r]
        assert all(d.fresh_telemetry(k).cancel_epoch == 7 for k in range(d.world))
        d.abort(r)
        assert d.result(r).finish_reason == "abort"
        victim = d.submit([1, 2, 3], LONG)
        d.wait_tokens(victim, 2)
        e = d.cancel("requests", [victim])
        assert e == 8 and all(a.cancelled == [victim] for a in d.wait_acks(e).values())
        assert d.result(victim).finish_reason == "abort"
        # Shut down with a request in the batch: its stream ends with abort, every rank
        # removes it at the same step and exits 0.
        last = d.submit([1, 2, 3], LONG)
        d.wait_tokens(last, 2)
        codes = d.shutdown()
        assert codes == {k: 0 for k in range(d.world)}
        assert d.result(last).finish_reason == "abort"
        recs = [removal(d, k, last) for k in range(d.world)]
        assert len({(x["reason"], x["step"]) for x in recs}) == 1 and recs[0]["reason"] == "shutdown"
        assert all(d.marker(k)["phase"] == "exiting" for k in range(d.world))


# -- failing closed -----------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("drop", [0, 5])
def test_plan_gap_makes_follower_fail_closed(tmp_path, drop, greedy):
    # drop=0: the first plan (an insert after idle); drop=5: a plan in mid-decode.
    with Deployment(tmp_path, mode="tp", env={"LOCKSTEP_TEST_DROP_PLAN_SEQ": str(drop)}) as d:
        prompts = [[1, 2, 3], [4, 5, 6, 7]]
        rids = [d.submit(p, 30) for p in prompts]
        codes = d.wait_exit([1], timeout=30)
        assert codes[1] == 1  # non-zero, but a clean exit: marker first
        marker = d.marker(1)
        assert marker["phase"] == "failed" and "plan gap" in marker["error"], marker
        assert f"plan {drop} " in marker["error"], marker
        assert "Traceback" not in d.log(1)
        # Rank 0 loses its peer and ends every stream with an error — never wrong tokens
        # (or with abort, when its peer watchdog's abort stage came first: the ring does
        # not always raise when a peer exits mid-step).
        d.wait_exit([0], timeout=30)
        assert d.marker(0)["phase"] in ("peer_lost", "failed")
        for rid, prompt in zip(rids, prompts, strict=True):
            res = d.result(rid, timeout=5)
            assert res.finish_reason in ("error", "abort") and res.error
            assert res.tokens == greedy(prompt, 30)[: len(res.tokens)]
        # The follower stopped before the hole: it never applied a later plan.
        assert not d.removals(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["single", "tp"], indirect=True)
def test_forged_and_wrong_key_messages_are_dropped_and_counted(deployment, reference):
    d = deployment
    ctx = zmq.Context.instance()
    wrong = Key.from_secret(secrets.token_bytes(32))
    forger = Signer(wrong, "mallory")
    for endpoint, bodies in (
        (d.requests_endpoint, [m.Generate("evil", [1, 2, 3], 4), m.Abort("evil")]),
        (d.plan_endpoint, [m.PlanHello(rank=1), m.PlanFetch(from_seq=0)]),
    ):
        s = configure(ctx.socket(zmq.DEALER))
        s.connect(endpoint)
        for body in bodies:
            s.send(forger.encode(body))  # wrong key
            good = bytearray(Channel("x", "y", sender="m", send_key=d.keys.plan
                                     if endpoint == d.plan_endpoint else d.keys.requests)
                             .pack(body))
            good[-1] ^= 1
            s.send(bytes(good))  # right key, tampered bytes
        s.send(b"garbage")
        s.close(linger=1000)

    def counted():
        t = d.telemetry(0)
        rj = t.rejects if t else {}
        return all(rj.get(k, 0) >= 2 for k in ("requests.unknown_key", "requests.bad_mac",
                                                "plan.unknown_key", "plan.bad_mac")) and rj
    rejects = poll_until(counted, 10, "the forged messages to be counted")
    assert rejects.get("requests.too_short", 0) >= 1 and rejects.get("plan.too_short", 0) >= 1
    # The marker carries the same counts (written on the telemetry tick, so poll).
    poll_until(lambda: (d.marker(0) or {}).get("extra", {}).get("rejects"), 10,
               "the marker to carry the reject counts")
    # Serving continues, and nothing forged reached the batch.
    assert d.generate(*PROMPTS[0]).tokens == reference[0]
    assert all(r["request_id"] != "evil" for r in d.removals(0))
    assert d.live_ranks() == set(range(d.world))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["single", "tp"], indirect=True)
def test_a_requester_that_vanishes_mid_stream_frees_the_batch(deployment):
    """A gateway that dies (its socket closed, no abort sent) must not leave rank 0
    decoding to the token cap: the first undeliverable chunk removes the request at the
    next step, on every rank, with reason `requester_gone`."""
    d = deployment
    ctx = zmq.Context.instance()
    chan = Channel("test", "requests", sender=f"gw-{secrets.token_hex(4)}",
                   send_key=d.keys.requests, accept=m.REQUESTS_OUT)
    s = configure(ctx.socket(zmq.DEALER))
    s.connect(d.requests_endpoint)
    rid = "gone-" + secrets.token_hex(4)
    s.send(chan.pack(m.Generate(rid, [3, 4, 5], 100_000)))
    got = 0
    while got < 5:  # the stream is running
        assert s.poll(20_000), "no tokens"
        msg = chan.unpack(s.recv())
        assert msg is not None
        # Steps the I/O thread drained together come as one TOKENS_BATCH.
        chunks = msg.body.chunks if isinstance(msg.body, m.TokensBatch) else [msg.body]
        assert all(c.request_id == rid and not c.finish_reason for c in chunks)
        got += sum(len(c.tokens) for c in chunks)
    s.close(linger=0)  # gone, without a word
    recs = [removal(d, k, rid) for k in range(d.world)]
    assert {(r["reason"], r["step"]) for r in recs} == {("requester_gone", recs[0]["step"])}
    assert recs[0]["n_tokens"] < 1000  # left long before its cap of 100000
    poll_until(lambda: d.stats().active == 0, 10, "rank 0 to have no active request")
    assert d.generate(*PROMPTS[0]).finish_reason == "length"  # and serving goes on


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deployment", ["single", "tp"], indirect=True)
def test_telemetry_reports_live_activity_and_memory(deployment):
    """Every rank's heartbeat carries what it is doing: the step counter moves with the
    work, `active` counts a running request, memory is the model's real footprint."""
    d = deployment
    before = {k: d.fresh_telemetry(k) for k in range(d.world)}
    rid = d.submit([7, 8, 9], 100_000)
    poll_until(lambda: all((t := d.fresh_telemetry(k)).active == 1 and t.step > before[k].step
                           for k in range(d.world)), 20, "every rank busy with the request")
    for k in range(d.world):
        t = d.fresh_telemetry(k)
        assert t.phase == "serving" and t.rank == k and t.pid == d.procs[k].pid
        assert t.mem_active > 0 and t.mem_peak >= t.mem_active
    d.abort(rid)
    assert d.result(rid).finish_reason == "abort"
    poll_until(lambda: all(d.fresh_telemetry(k).active == 0 for k in range(d.world)), 20,
               "every rank idle again")


# -- idle --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_idle_ranks_wait_on_the_bus(tp):
    procs = [psutil.Process(p.pid) for p in tp.procs.values()]
    before = [p.cpu_times() for p in procs]
    t0 = os.times().elapsed
    poll_until(lambda: os.times().elapsed - t0 >= 2.0, 5, "2 s", interval=0.1)
    after = [p.cpu_times() for p in procs]
    for b, a in zip(before, after, strict=True):
        used = (a.user + a.system) - (b.user + b.system)
        assert used / 2.0 < 0.05, f"an idle rank used {used / 2.0:.1%} of a core"


@pytest.mark.timeout(90)
def test_sigterm_to_every_rank_exits_cleanly_at_one_step(tmp_path):
    """What a verified teardown does first: SIGTERM to each rank's process group."""
    with Deployment(tmp_path, mode="tp", env={"LOCKSTEP_TEST_STEP_DELAY_S": "0.01"}) as d:
        r = d.submit([1, 2, 3], LONG)
        d.wait_tokens(r, 3)
        for p in d.procs.values():
            os.killpg(p.pid, signal.SIGTERM)
        assert d.wait_exit(timeout=20) == {0: 0, 1: 0}
        assert d.result(r, timeout=5).finish_reason == "abort"
        assert all(d.marker(k)["phase"] == "exiting" for k in range(2))
        recs = [removal(d, k, r) for k in range(2)]
        assert {(x["reason"], x["step"]) for x in recs} == {("shutdown", recs[0]["step"])}
