"""The KV budget's accounting (services/rank/kv_budget.py) against what mlx-lm really
allocates: the tiny preset's model driven through mlx-lm's own BatchGenerator, rows of
different lengths joining at different steps (left padding, prompt chunks, the 256-slot
growth, removals shifting the buffer), the caches' nbytes read after every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from common.rankspec import KvBudgetRefused, auto_kv_budget_bytes
from models.tinymodel.build import build_model
from services.rank.kv_budget import GROWTH, UNBOUNDED, KvBudget, Row, slot_bytes
from services.rank.wait_queue import AGE_S, Waiting, WaitQueue
from tests.support.clock import FakeClock

CHUNK = 64  # prompt tokens per prefill chunk


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, dict]:
    path = build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")
    model, _ = load(str(path))
    return model, json.loads((Path(path) / "config.json").read_text())


def model_slot_bytes(cfg: dict, itemsize: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize


def test_slot_bytes_is_the_models_kv_per_token(tiny):
    model, cfg = tiny
    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=CHUNK)
    gen.insert([[5, 6, 7, 8]], max_tokens=[4])
    while not len(gen._generation_batch):
        gen.next()
    itemsize = next(c for c in gen._generation_batch.prompt_cache).keys.dtype.size
    assert slot_bytes(gen._generation_batch.prompt_cache) == model_slot_bytes(cfg, itemsize)


# (step to insert at, prompt tokens, max_tokens): short and long, joining mid-stream
PLANS = {64: [(0, 5, 300), (0, 70, 20), (3, 300, 8), (10, 40, 60), (30, 200, 30),
              (60, 12, 250), (61, 257, 3)],
         512: [(0, 5, 200), (0, 1100, 20), (2, 600, 40), (5, 513, 9), (9, 40, 120),
               (40, 1030, 30), (41, 257, 3), (90, 777, 50)]}


@pytest.mark.parametrize("chunk", sorted(PLANS))
def test_the_reservation_bounds_what_the_caches_allocate_at_every_step(tiny, chunk):
    model, cfg = tiny
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=8, prefill_batch_size=4,
                         prefill_step_size=chunk)
    plan = PLANS[chunk]
    live: dict[int, int] = {}  # uid -> its length as rank 0 counts it: prompt + emitted
    itemsize = model.parameters()["model"]["embed_tokens"]["weight"].dtype.size  # the KV's
    kv = KvBudget(1 << 40, model_slot_bytes(cfg, itemsize), GROWTH)
    ratios = []
    for step in range(400):
        for at, n, m in plan:
            if at == step:
                prompt = [1 + (i * 7 + n) % 90 for i in range(n)]
                (uid,) = gen.insert([prompt], max_tokens=[m])
                live[uid] = n
        if not live:
            break
        need = kv.need(live.values())  # what the next step may hold, decided before it
        _, responses = gen.next()
        held = gen.prompt_cache_nbytes
        assert held <= need, (step, held, need, live)
        ratios.append(held / need)
        for r in responses:
            if r.finish_reason is not None:
                live.pop(r.uid)
            elif r.uid in live:
                live[r.uid] += 1
    assert not live, "every row finished"
    # not a vacuous bound: at some step the caches held most of what was reserved
    assert max(ratios) > 0.5, max(ratios)


def test_what_fits_what_waits_and_what_never_runs():
    kv = KvBudget(budget=100 * 1000, slot=100, slack=GROWTH)  # 1000 slots
    assert kv.max_tokens_alone(700) == 1000 - GROWTH - 700
    assert kv.fits([743]) and not kv.fits([744])  # 744 + 1 + 256 > 1000 slots
    # two rows are each as long as the longer: 2 x (300 + 1 + 256) > 1000
    assert not kv.fits([300, 10]) and kv.fits([200, 10])  # 2 x 457 <= 1000
    assert kv.need([]) == 0
    assert kv.need([10, 20]) == 2 * (21 + GROWTH) * 100
    assert "budget of 100000 bytes" in kv.refusal(744)


def test_victims_free_the_most_bytes_and_spare_the_protected():
    kv = KvBudget(budget=100 * 1000, slot=100, slack=GROWTH)  # 1000 slots
    assert kv.victims({"a": Row(100, 0), "b": Row(150, 1)}) == []  # 2 x 407 fits
    # three rows of ~ 400 slots do not fit; the longest leaving shortens every buffer
    rows = {"a": Row(130, 0), "b": Row(180, 1), "c": Row(120, 2)}
    assert kv.victims(rows) == ["b"]  # 3 x 437 > 1000; without b, 2 x 387 fits
    # b protected: a and c free as much (437 each); c, the later admitted, leaves
    assert kv.victims({**rows, "b": Row(180, 1, protected=True)}) == ["c"]
    # equal lengths: the latest admitted leaves first; never the last row
    assert kv.victims({"x": Row(600, 0), "y": Row(600, 5)}) == ["y"]
    assert kv.victims({"x": Row(900, 0)}) == []




def test_the_auto_budget_shares_the_host_and_refuses_nothing_left():
    gib = 1 << 30
    got = auto_kv_budget_bytes(24 * gib, weights=2 * gib, world_size=2, prompt_cache_bytes=3 * gib)
    assert got == (int(24 * gib * 0.9) - 2 * gib) // 2 - 3 * gib
    with pytest.raises(KvBudgetRefused) as ei:
        auto_kv_budget_bytes(8 * gib, weights=6 * gib, world_size=2, prompt_cache_bytes=1 * gib)
    assert "less the weights' 6442450944 bytes" in str(ei.value) and "--kv-budget-bytes" in str(ei.value)


def test_room_for_a_higher_priority_preempts_only_lower_priorities():
    kv = KvBudget(budget=100 * 1000, slot=100, slack=GROWTH)  # 1000 slots
    rows = {"lo": Row(200, 0, priority=10), "mid": Row(150, 1, priority=0)}
    # a short request at priority -5 does not fit beside both (3 x 457 > 1000): the
    # lowest priority leaves first, and that is enough (2 x 407 fits)
    assert kv.room_for(rows, 20, -5, max_rows=16) == ["lo"]
    # at priority 0 only "lo" is below it; at 10 nobody is: it waits
    assert kv.room_for(rows, 20, 0, max_rows=16) == ["lo"]
    assert kv.room_for(rows, 20, 10, max_rows=16) is None
    # slots alone (no budget): the batch full of 2, one lower-priority row makes room
    assert UNBOUNDED.room_for(rows, 20, -1, max_rows=2) == ["lo"]
    assert UNBOUNDED.room_for(rows, 20, -1, max_rows=3) == []
    # protected (re-admitted, no progress yet) and pinned rows are never taken
    assert kv.room_for({**rows, "lo": Row(200, 0, priority=10, protected=True)}, 20, -5,
                       max_rows=16) == ["mid"]
    assert kv.room_for({"p": Row(600, 0, priority=10, pinned=True)}, 300, -5, 16) is None


def test_the_wait_queue_orders_by_priority_then_arrival():
    q = WaitQueue()
    for rid, prio, arrival in [("a", 0, 1), ("b", 10, 2), ("c", -5, 3), ("d", 0, 4),
                               ("e", 0, 0)]:  # e: a preempted request, its old arrival
        q.push(rid, Waiting(prio, arrival))
    assert [q.pop() for _ in range(2)] == ["c", "e"]
    q.remove("a")
    assert list(q) == ["d", "b"] and "a" not in q and q.head() == "d"
    assert q.by_priority() == {0: 1, 10: 1} and len(q) == 2
    with pytest.raises(ValueError):
        q.push("d", Waiting(0, 9))


def test_a_waiting_request_ages_past_a_stream_of_more_urgent_ones():
    """Priority 10 behind a steady stream at 0: once its wait is worth ten levels
    (10 x AGE_S seconds) it is the head, and nothing newer at 0 passes it after that."""
    clock = FakeClock(1000.0)
    q = WaitQueue(clock=clock)
    q.push("low", Waiting(10, 0, since=clock.now))
    heads = []
    for i in range(1, 200):
        clock.now += 1.0
        q.push(f"u{i}", Waiting(0, i, since=clock.now))
        heads.append(q.pop())
        if heads[-1] == "low":
            break
    assert heads[-1] == "low" and len(heads) == 10 * AGE_S, heads[-3:]
    assert heads[:-1] == [f"u{i}" for i in range(1, len(heads))]
    # no aging: strict priority, the low one would wait for ever
    strict = WaitQueue(age_s=0, clock=clock)
    strict.push("low", Waiting(10, 0, since=0.0))
    strict.push("u", Waiting(0, 1, since=clock.now))
    assert strict.head() == "u"


def admit_all(q: WaitQueue, ws: dict[str, Waiting]) -> list[str]:
    out = []
    while len(q):
        rid = q.pop()
        q.admitted(rid, ws[rid])
        out.append(rid)
    return out


def test_tenants_take_turns_by_weight_within_a_priority():
    q, ws = WaitQueue(), {}
    for i in range(6):  # alice floods first
        ws[f"a{i}"] = Waiting(0, i, "alice")
    for i in range(3):  # then bob (weight 1) and carol (weight 2)
        ws[f"b{i}"] = Waiting(0, 10 + i, "bob")
        ws[f"c{i}"] = Waiting(0, 20 + i, "carol", weight=2)
    for rid, w in ws.items():
        q.push(rid, w)
    order = admit_all(q, ws)
    # turns: each admission costs 1/weight; ties go to the earliest arrival
    assert order[:6] == ["a0", "b0", "c0", "c1", "a1", "b1"], order
    assert order.index("c2") < order.index("a2") and order[-3:] == ["a3", "a4", "a5"]
    # a higher priority comes first whatever the turns
    q.push("urgent", Waiting(-1, 99, "alice"))
    q.push("later", Waiting(0, 98, "bob"))
    assert q.head() == "urgent"


def test_a_tenant_back_from_a_quiet_spell_gets_no_burst():
    q, ws = WaitQueue(), {}
    for i in range(4):
        ws[f"a{i}"] = Waiting(0, i, "alice")
        q.push(f"a{i}", ws[f"a{i}"])
    assert admit_all(q, ws) == ["a0", "a1", "a2", "a3"]  # alice served 4 alone
    for i in range(4):  # bob was away all along; now both wait
        ws[f"b{i}"], ws[f"a{4 + i}"] = Waiting(0, 10 + i, "bob"), Waiting(0, 20 + i, "alice")
        q.push(f"b{i}", ws[f"b{i}"])
        q.push(f"a{4 + i}", ws[f"a{4 + i}"])
    order = admit_all(q, ws)
    # bob starts at alice's last turn (3), not at 0: one turn to catch up, then in turn
    assert order[:6] == ["b0", "b1", "a4", "b2", "a5", "b3"], order


def test_the_supervisor_resolves_the_budget_per_deployment(monkeypatch, tmp_path):
    from services.supervisor import job_launch
    from services.supervisor.plan import DeployPlan
    from services.supervisor.settings import SupervisorSettings

    gib = 1 << 30
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    plan = DeployPlan(model_path=str(tmp_path), tp=2, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    monkeypatch.setattr(job_launch, "host_memory", lambda: 16 * gib)
    auto = SupervisorSettings(prompt_cache_bytes=gib)
    want = (int(16 * gib * 0.9) - 4096) // 2 - gib
    assert job_launch.kv_budget(auto, plan) == want
    assert job_launch.rank_settings(auto, plan).kv_budget_bytes == want
    assert job_launch.kv_budget(SupervisorSettings(kv_budget_bytes=123), plan) == 123
    assert job_launch.kv_budget(SupervisorSettings(kv_budget_bytes=0), plan) == 0  # off
    monkeypatch.setattr(job_launch, "host_memory", lambda: gib)
    with pytest.raises(KvBudgetRefused):  # (0.9 GiB - weights) / 2 - 1 GiB < 0
        job_launch.kv_budget(auto, plan)
