"""The rank service's parts in-process: plan sequencing, samplers, the engine's
divergence checks, the removal record and the launch environment."""

from __future__ import annotations

import os
import stat

import mlx.core as mx
import pytest

from common.messages import Plan, PlanInsert, PlanRemove, RemoveReason, SeededSampling
from common.rank_env import DEFAULTS, rank_environment
from common.rankspec import RankSettings
from services.rank.planwire import PlanOrder, ReplayBuffer
from services.rank.removals import RemovalLog, read_removals, token_digest
from services.rank.sampling import make_sampler, token_seed


def sampler(temperature: float, top_p: float, seed: int):
    return make_sampler(SeededSampling(temperature=temperature, top_p=top_p, seed=seed))


def plan(seq: int, **kw) -> Plan:
    return Plan(seq=seq, step=seq, advance=True, **kw)


# -- plan sequencing ---------------------------------------------------------------------


def test_replay_buffer_replays_and_reports_holes():
    buf = ReplayBuffer(capacity=4)
    for s in range(3):
        buf.record(plan(s))
    assert [p.seq for p in buf.fetch(1).plans] == [1, 2]
    assert buf.fetch(3) .plans == [] and not buf.fetch(3).missing  # nothing newer yet
    buf.record(plan(3), keep=False)  # sent nowhere, kept nowhere (test seam)
    assert buf.fetch(3).missing
    assert [p.seq for p in buf.fetch(2).plans] == [2]  # a hole ends the batch
    for s in range(4, 9):
        buf.record(plan(s))
    assert buf.fetch(1).missing  # evicted
    assert [p.seq for p in buf.fetch(5).plans] == [5, 6, 7, 8]
    with pytest.raises(ValueError):
        buf.record(plan(11))


def test_plan_order_delivers_strictly_in_sequence():
    order = PlanOrder()
    assert order.offer(plan(0)) == []  # not joined yet
    order.start(0)
    assert [p.seq for p in order.offer(plan(0))] == [0]
    assert order.offer(plan(2)) == [] and order.gap
    assert order.offer(plan(0)) == []  # duplicate
    assert [p.seq for p in order.offer(plan(1))] == [1, 2] and not order.gap
    assert order.expected == 3


# -- sampling ----------------------------------------------------------------------------


def test_token_seeds_are_deterministic_and_distinct():
    seeds = {token_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000
    assert token_seed(7, 3) == token_seed(7, 3) and token_seed(-1, 0) == token_seed(2**64 - 1, 0)


def test_sampler_ignores_global_rng_and_other_requests():
    assert sampler(0.0, 1.0, 5) is None  # greedy: the batch's shared argmax
    logits = mx.random.normal((1, 64), key=mx.random.key(0)) * 3

    def draw(n: int, noise: bool) -> list[int]:
        s = sampler(0.8, 0.9, 1234)
        other = sampler(1.0, 1.0, 1234)
        out = []
        for _ in range(n):
            if noise:  # extra global draws and another request's draws in between
                mx.eval(mx.random.uniform(shape=(3,)))
                mx.eval(other(logits))
            out.append(int(s(logits).item()))
        return out

    a = draw(30, noise=False)
    assert a == draw(30, noise=True)
    assert len(set(a)) > 1  # it does sample
    assert a != [int(sampler(0.8, 0.9, 99)(logits).item()) for _ in range(30)]


# -- engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    from mlx_lm import load

    from tests.e2e.rank_harness import model_dir

    m, tok = load(str(model_dir()))
    return m, sorted(tok.eos_token_ids)


def ins(rid: str, n: int = 4, **kw) -> PlanInsert:
    return PlanInsert(request_id=rid, prompt=[1, 2, 3], max_tokens=n,
                      sampling=SeededSampling(temperature=kw.get("t", 0.0), seed=kw.get("seed", 0)),
                      stop_token_ids=kw.get("stop", []))


def test_engine_steps_and_detects_divergence(model):
    from services.rank.engine import Divergence, Engine

    e = Engine(model[0], model[1], RankSettings())
    assert e.apply([], [ins("a", 3), ins("b", 5)]) == []
    assert (e.by_rid["a"].uid, e.by_rid["b"].uid) == (0, 1)
    finished = []
    while e.has_work():
        finished += e.next()[1]
    assert [(f.active.request_id, f.reason) for f in finished] == [("a", "length"), ("b", "length")]
    assert len(e.by_rid) == 0 and [len(f.active.tokens) for f in finished] == [3, 5]
    with pytest.raises(Divergence, match="not in this batch"):
        e.apply([PlanRemove("a", RemoveReason.ABORT)], [])
    e.apply([], [ins("c", 50)])
    with pytest.raises(Divergence, match="already in this batch"):
        e.apply([], [ins("c")])
    removed = e.apply([PlanRemove("c", RemoveReason.ABORT)], [])
    assert [(f.active.request_id, f.reason, f.step) for f in removed] == [("c", "abort", e.step)]
    e.gen.insert([[1, 2]])  # an insert on this rank alone (a canary, say) shifts every uid
    with pytest.raises(Divergence, match="plan order predicts"):
        e.apply([], [ins("d")])


def test_engine_stop_token_is_not_emitted(model):
    from services.rank.engine import Engine

    e = Engine(model[0], model[1], RankSettings())
    e.apply([], [ins("a", 6)])
    free = []
    while e.has_work():
        free += [x.token for x in e.next()[0]]
    e.apply([], [ins("b", 6, stop=[free[2]])])
    got = []
    while e.has_work():
        got += e.next()[0]
    assert [x.token for x in got] == free[:2] + [None]
    assert got[-1].finish_reason == "stop" and got[-1].active.tokens == free[:2]


# -- removals and environment ---------------------------------------------------------


def test_removal_log_appends_private_lines(tmp_path):
    path = tmp_path / "d" / "rank-0.removals.jsonl"
    log = RemovalLog(path)
    log.append("r1", 0, 5, "abort", [1, 2])
    log.append("r2", 1, 6, "length", [])
    log.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    recs = read_removals(path)
    assert [(r["request_id"], r["step"], r["reason"], r["n_tokens"]) for r in recs] == \
        [("r1", 5, "abort", 2), ("r2", 6, "length", 0)]
    assert recs[0]["tokens_sha"] == token_digest([1, 2]) != token_digest([2, 1])


def test_rank_environment(tmp_path, monkeypatch):
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr("sys.platform", "linux")
    base = {"TEMP": "/x", "MLX_MAX_OPS_PER_BUFFER": "4", "LD_PRELOAD": "/other.so",
            "LOCKSTEP_OPENBLAS_LIB": str(lib)}
    env = rank_environment(RankSettings(), base)
    assert "TEMP" not in env and env["MLX_MAX_OPS_PER_BUFFER"] == "4"  # operator's value
    assert {k: env[k] for k in DEFAULTS if k != "MLX_MAX_OPS_PER_BUFFER"} == \
        {k: v for k, v in DEFAULTS.items() if k != "MLX_MAX_OPS_PER_BUFFER"}
    assert env["LD_PRELOAD"] == f"{lib} /other.so" and env["OPENBLAS_NUM_THREADS"] == "1"
    assert rank_environment(RankSettings(), {**base, "OPENBLAS_NUM_THREADS": "2"})[
        "OPENBLAS_NUM_THREADS"] == "2"
    assert rank_environment(RankSettings(), env)["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert "LD_PRELOAD" not in rank_environment(RankSettings(openblas=False),
                                                {"LOCKSTEP_OPENBLAS_LIB": str(lib)})
    assert "LD_PRELOAD" not in rank_environment(
        RankSettings(), {"LOCKSTEP_OPENBLAS": "0", "LOCKSTEP_OPENBLAS_LIB": str(lib)})
    assert "LD_PRELOAD" not in rank_environment(
        RankSettings(), {"LOCKSTEP_OPENBLAS_LIB": str(tmp_path / "missing.so")})
    monkeypatch.setattr("sys.platform", "darwin")
    assert "LD_PRELOAD" not in rank_environment(RankSettings(), {"LOCKSTEP_OPENBLAS_LIB": str(lib)})
    assert base["TEMP"] == "/x"  # the caller's mapping is untouched


def test_rank_environment_pins_the_openblas_kernel_determinism_holds_with(tmp_path, monkeypatch):
    """OpenBLAS's per-CPU kernel choice would make the deterministic mode hold on one
    CPU family and not the next (docs/rank.md "One kernel per CPU family")."""
    from common import rank_env

    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr("sys.platform", "linux")
    base = {"LOCKSTEP_OPENBLAS_LIB": str(lib)}
    for kernel in ("SkylakeX", "SandyBridge"):
        monkeypatch.setattr(rank_env, "coretype", lambda k=kernel: k)
        assert rank_environment(RankSettings(), base)["OPENBLAS_CORETYPE"] == kernel
    assert rank_environment(RankSettings(), {**base, "OPENBLAS_CORETYPE": "Haswell"})[
        "OPENBLAS_CORETYPE"] == "Haswell"  # an operator's value wins
    assert "OPENBLAS_CORETYPE" not in rank_environment(RankSettings(openblas=False), base)
    monkeypatch.setattr(rank_env, "coretype", lambda: None)  # neither kernel would run
    assert "OPENBLAS_CORETYPE" not in rank_environment(RankSettings(), base)
    monkeypatch.undo()
    avx512 = "fpu sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl"
    assert rank_env.coretype(frozenset(avx512.split())) == "SkylakeX"  # an Intel Xeon
    assert rank_env.coretype(frozenset("fpu sse2 avx avx2 fma".split())) == "SandyBridge"  # Zen 3
    assert rank_env.coretype(frozenset("fpu sse2 avx avx512f".split())) == "SandyBridge"
    assert rank_env.coretype(frozenset("fpu sse2 sse4_2".split())) is None
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {avx512}\n")
    assert rank_env.cpu_flags(str(info)) == frozenset(avx512.split())
    assert rank_env.cpu_flags(str(tmp_path / "none")) == frozenset()
