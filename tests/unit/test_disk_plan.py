"""Rank 0's disk-tier decisions (services/rank/disk_plan.py) inside its prefix-cache
planner: what is written through, what a prompt loads, what every rank drops."""

from __future__ import annotations

import numpy as np

from common.messages import CacheOpKind, DiskIndex
from services.rank.disk_plan import DiskPlanner
from services.rank.disk_tier import entry_key
from services.rank.prefix_cache import CachePlanner


def kinds(ops) -> list[tuple]:
    return [(o.kind.value, o.entry_id, o.key[:6], o.persist) for o in ops]


def planner(budget=1000, followers=0, boot=None, mem_entries=4, mem_bytes=10_000,
            load=lambda key, n: 50):
    d = DiskPlanner(budget, followers, boot or {})
    p = CachePlanner(mem_entries, mem_bytes, trimmable=True, disk=d)
    p.disk_load = load
    return p, d


def test_a_store_is_written_through_once_the_tier_is_ready():
    p, d = planner()
    t = list(range(100, 140))
    p.finished("a", t, nbytes=50)
    (op,) = p.take_ops()
    assert op.kind is CacheOpKind.STORE and op.persist and op.key == entry_key(t)
    assert list(d.index) == [entry_key(t)] and d.nbytes == 50


def test_nothing_is_written_or_loaded_until_every_follower_reported():
    p, d = planner(followers=2)
    t = list(range(100, 140))
    p.finished("a", t, nbytes=50)
    assert not p.take_ops()[0].persist and not d.ready
    d.report(DiskIndex(rank=1, seq=1, verified=[]))
    assert not d.ready
    d.report(DiskIndex(rank=2, seq=1, verified=[]))
    assert d.ready and d.acks(3) == [0, 1, 1]


def test_boot_keeps_only_what_every_rank_verified_and_drops_the_rest_everywhere():
    a, b, c = (list(range(k, k + 40)) for k in (100, 200, 300))
    ka, kb, kc = entry_key(a), entry_key(b), entry_key(c)
    boot = {ka: (a, 40, 1.0), kb: (b, 40, 2.0)}
    p, d = planner(followers=1, boot=boot)
    d.report(DiskIndex(rank=1, seq=1, verified=[ka, kc]))  # b bad on rank 1, c only there
    assert sorted(o.key for o in p.take_ops() if o.kind is CacheOpKind.DROP) == sorted([kb, kc])
    assert list(d.index) == [ka]
    d.report(DiskIndex(rank=1, seq=1, verified=[]))  # a re-sent report is taken once
    assert list(d.index) == [ka] and not p.take_ops()


def test_a_prompt_held_longer_on_disk_loads_it_before_its_insert():
    t = list(range(100, 160))
    p, d = planner(boot={entry_key(t): (t, 50, 1.0)})
    p.take_ops()
    prompt = t + [1, 2, 3]
    assert p.peek(np.asarray(prompt)) == (0, len(t))  # prefill saved, for admission
    eid, n = p.match(prompt)
    assert n == len(t) and eid
    (load,) = p.take_loads()
    assert (load.kind, load.entry_id, load.key, load.n_tokens, load.nbytes) == \
        (CacheOpKind.LOAD, eid, entry_key(t), len(t), 50)
    assert d.hits == 1 and d.hit_tokens == len(t)
    # now in memory too: the next prompt hits memory, no second load
    assert p.match(prompt + [4]) == (eid, len(t))
    assert p.take_loads() == []


def test_a_file_rank_0_cannot_read_is_dropped_everywhere_and_the_prompt_prefills():
    t = list(range(100, 160))
    p, d = planner(boot={entry_key(t): (t, 50, 1.0)}, load=lambda key, n: 0)
    p.take_ops()
    assert p.match(t + [1]) == (0, 0)
    assert kinds(p.take_loads()) == [("drop", 0, entry_key(t)[:6], False)]
    assert not d.index and p.misses == 1


def test_disk_budget_drops_lru_and_extended_entries():
    p, d = planner(budget=100)
    t1 = list(range(100, 140))
    p.finished("a", t1, nbytes=40)
    p.finished("b", t1 + [1, 2], nbytes=45)  # extends a: a dropped from disk too
    p.finished("c", list(range(500, 540)), nbytes=60)  # b no longer fits with c
    got = kinds(p.take_ops())
    drops = [g[2] for g in got if g[0] == "drop"]
    assert drops == [entry_key(t1)[:6], entry_key(t1 + [1, 2])[:6]]
    assert list(d.index) == [entry_key(list(range(500, 540)))] and d.nbytes == 60


def test_a_failed_write_is_dropped_and_clear_empties_the_disk_index():
    p, d = planner()
    t = list(range(100, 140))
    p.finished("a", t, nbytes=50)
    p.take_ops()
    d.report(DiskIndex(rank=1, seq=2, failed=[entry_key(t), "unknown"]))
    assert kinds(p.take_ops()) == [("drop", 0, entry_key(t)[:6], False)]
    p.finished("b", list(range(300, 340)), nbytes=50)
    p.request_clear()
    assert kinds(p.take_ops()) == [("clear", 0, "", False)] and not d.index


def test_a_follower_without_a_disk_tier_turns_writing_off():
    p, d = planner(followers=1)
    d.report(DiskIndex(rank=1, seq=1, off=True))
    p.finished("a", list(range(100, 140)), nbytes=50)
    assert not p.take_ops()[0].persist
