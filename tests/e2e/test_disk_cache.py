"""The prefix cache's disk tier on real ranks, TP=2 and PP=2 (services/rank/disk_tier.py,
disk_plan.py): what one deployment wrote, the next one on the same home serves from
disk, token for token as a cache-off rank computes it (greedy and seeded); files that
no longer check out are counted, removed and never loaded, on whichever rank they are;
every rank's own record of its disk index equals rank 0's; the byte budget holds.

Three deployments in a row share one home and one cache key, as `lockstep up` restarted
on the same home would: (1) writes a conversation; (2) serves its next turn from disk;
one byte of rank 1's file is then flipped while nothing runs, and (3) drops that entry
on every rank at start-up; a byte of one of rank 0's files flipped while (3) runs is
caught when rank 0 reads it, before any rank is told to load it.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from services.rank.disk_tier import entry_key
from services.rank.prefix_store import cache_index_path, read_cache_index
from tests.e2e.rank_harness import Deployment, words

SETTINGS = {"prompt_cache_entries": 3, "prefill_step": 16,
            "prompt_cache_disk_bytes": 64 << 20}
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One rank, prefix cache off (so no disk tier either), the same settings otherwise."""
    with Deployment(tmp_path_factory.mktemp("ref"),
                    settings={**SETTINGS, "prompt_cache_entries": 0}) as d:
        yield d


def cached(r) -> int:
    return r.chunks[0].cached_tokens


def disk_records(d: Deployment, rank: int) -> list:
    recs = read_cache_index(cache_index_path(d.paths, d.deployment_id, rank))
    return [r["disk"] for r in recs]


def last_disk(d: Deployment, timeout: float = 10.0) -> list:
    """Every rank's disk index after the last plan that changed its store, once every
    rank applied it (a follower records it a moment after rank 0): one list."""
    def same():
        views = [(disk_records(d, r) or [None])[-1] for r in range(d.world)]
        return all(v == views[0] for v in views) and views
    return d.wait(same, timeout, "every rank's disk index identical")[0]


def rank_files(home: Path, rank: int) -> list[Path]:
    return sorted((home / "kvcache").glob(f"*/*-rank{rank}/*.safetensors"))


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def stats(d: Deployment, rank: int):
    return d.fresh_telemetry(rank).cache


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_disk_tier_survives_restarts_and_rejects_tampered_files(mode, reference, tmp_path):
    ref = reference
    home, key = tmp_path / "home", secrets.token_bytes(32)

    def deploy(name: str) -> Deployment:
        return Deployment(tmp_path / name, mode=mode, settings=SETTINGS, home=home,
                          cache_key=key)

    a = words(1, 120)
    with deploy("one") as d:
        ra = d.generate(a, max_tokens=12)
        b = a + ra.tokens + words(2, 40)
        rb = d.generate(b, max_tokens=12)
        assert cached(rb) == len(a) + len(ra.tokens)  # memory tier, as before
        s = d.generate(words(3, 90), max_tokens=10, temperature=0.9, seed=77)
        on_disk = dict(last_disk(d))
        # a's entry is extended by b's: dropped; b's and the seeded one's are kept
        assert len(on_disk) == 2 and entry_key(b + rb.tokens) in on_disk
        d.shutdown()
    for r in range(2):  # every rank wrote its own part of both entries
        assert len(rank_files(home, r)) == 2

    # (2) the next turn of the conversation, on a new deployment: served from disk
    c = b + rb.tokens + words(4, 30)
    with deploy("two") as d:
        rc = d.generate(c, max_tokens=12)
        assert cached(rc) == len(b) + len(rb.tokens)
        assert rc.tokens == ref.generate(c, max_tokens=12).tokens
        seeded = words(3, 90) + s.tokens + words(5, 20)
        rs = d.generate(seeded, max_tokens=12, temperature=0.9, seed=78)
        assert cached(rs) >= len(words(3, 90))
        assert rs.tokens == ref.generate(seeded, max_tokens=12, temperature=0.9,
                                         seed=78).tokens
        st = stats(d, 0)
        assert (st.disk_hits, st.disk_hit_tokens) == (2, cached(rc) + cached(rs))
        assert all(stats(d, r).disk_loaded == 2 for r in range(2))
        held = dict(last_disk(d))
        assert entry_key(c + rc.tokens) in held
        d.shutdown()

    # (3) one byte of rank 1's file for c's entry flipped while nothing runs
    victim = next(p for p in rank_files(home, 1) if p.stem == entry_key(c + rc.tokens))
    flip(victim, victim.stat().st_size - 3)
    with deploy("three") as d:
        d.wait(lambda: (t := d.telemetry(1)) and t.cache and t.cache.disk_rejected == 1, 10,
               "rank 1's start-up scan rejecting its file")
        assert not victim.exists()
        d.wait(lambda: disk_records(d, 1) and entry_key(c + rc.tokens)
               not in dict(last_disk(d)), 10, "the entry dropped on every rank")
        assert not any(p.stem == entry_key(c + rc.tokens) for p in rank_files(home, 0))
        (k,) = dict(last_disk(d))  # the seeded conversation's entry is all that is left
        rc2 = d.generate(c + rc.tokens + [7], max_tokens=12)
        assert cached(rc2) < len(c)  # not from the bad entry
        assert rc2.tokens == ref.generate(c + rc.tokens + [7], max_tokens=12).tokens

        # a byte of rank 0's copy of the seeded entry, flipped while it runs: rank 0
        # reads its own file before any LOAD, drops it everywhere, and prefills
        mine = next(p for p in rank_files(home, 0) if p.stem == k)
        flip(mine, mine.stat().st_size // 2)
        more = seeded + rs.tokens + words(6, 10)
        rm = d.generate(more, max_tokens=12, temperature=0.9, seed=79)
        assert cached(rm) < len(seeded)
        assert rm.tokens == ref.generate(more, max_tokens=12, temperature=0.9, seed=79).tokens
        assert stats(d, 0).disk_rejected == 1 and stats(d, 1).disk_rejected == 1
        assert stats(d, 0).disk_hits == 0
        d.wait(lambda: k not in dict(last_disk(d)), 10, "the entry dropped on every rank")
        assert not any(p.stem == k for r in range(2) for p in rank_files(home, r))


def test_disk_budget_holds_under_distinct_long_prompts(tmp_path):
    budget = 3 << 20
    with Deployment(tmp_path, settings={**SETTINGS, "prompt_cache_disk_bytes": budget},
                    cache_key=secrets.token_bytes(32)) as d:
        sizes = []
        for i in range(8):
            d.generate(words(100 + i, 300), max_tokens=4)
            st = stats(d, 0)
            sizes.append(st.disk_bytes)
            assert st.disk_bytes <= budget, sizes
        folder = sum(p.stat().st_size for p in rank_files(d.paths.home, 0))
        assert 0 < folder <= budget
        assert len(last_disk(d)) < 8  # some were dropped to keep within it


def test_a_full_disk_keeps_the_cache_in_memory_and_fails_no_request(reference, tmp_path):
    """Every rank's kvcache folder on a 64 KiB tmpfs (an entry of the tiny model is
    bigger): no write succeeds on any rank; requests are served as ever, from memory
    too; each entry's failure drops it everywhere, and a rank that failed says so once.
    Which rank fails which entry is a race, not a contract: a follower's writer may find
    an entry already dropped because rank 0's write of it failed first (CI saw rank 1
    fail one entry and skip the other), so the counts are asserted across ranks."""
    home = tmp_path / "home"
    (home / "kvcache").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(home / "kvcache")],
                   check=True)
    try:
        with Deployment(tmp_path / "d", mode="tp", settings=SETTINGS, home=home,
                        cache_key=secrets.token_bytes(32)) as d:
            a = words(40, 200)
            ra = d.generate(a, max_tokens=12)
            b = a + ra.tokens + words(41, 20)
            rb = d.generate(b, max_tokens=12)
            assert cached(rb) == len(a) + len(ra.tokens)  # the memory tier serves it
            assert (ra.tokens, rb.tokens) == (ref_tokens(reference, a), ref_tokens(reference, b))
            # Two entries were stored, each failed on at least one rank.
            d.wait(lambda: sum(t.cache.disk_write_errors for r in range(2)
                               if (t := d.telemetry(r)) and t.cache) >= 2, 20,
                   "both entries' failed writes")
            d.wait(lambda: last_disk(d) == [], 20, "the failed entries dropped everywhere")
            for r in range(2):
                st = stats(d, r)
                assert (st.disk_written, st.disk_entries) == (0, 0), st
                warned = [ln for ln in d.log(r).splitlines() if "WARNING" in ln and "disk" in ln]
                assert len(warned) == min(1, st.disk_write_errors), warned  # not one per entry
    finally:
        subprocess.run(["umount", str(home / "kvcache")], check=False)


def ref_tokens(ref: Deployment, prompt: list[int]) -> list[int]:
    return ref.generate(prompt, max_tokens=12).tokens
