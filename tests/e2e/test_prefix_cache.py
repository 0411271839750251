"""The prefix cache on real ranks, TP=2 and PP=2: greedy output with the cache equals the
output without it (a cache-off rank), token for token, in every way a request can meet
the cache; every rank's own index record equals rank 0's after every plan.

Scenarios run in order on one deployment per mode (the store carries state from one to
the next, as a server's would): a miss, a partial-prefix hit on a conversation's own
reply, a hit covering the whole prompt, a hit on an entry evicted by concurrent inserts
while the request runs, an abort mid-prefill (nothing stored), a cancel epoch removing a
request inserted from cache, seeded sampling. `prefill_step` 16 and a 20 ms step delay on
rank 0 make a long prompt's prefill last many steps, so an abort lands inside it.
"""

from __future__ import annotations

import pytest

from services.rank.prefix_store import cache_index_path, read_cache_index
from tests.e2e.rank_harness import Deployment, poll_until, words

SETTINGS = {"prompt_cache_entries": 3, "prefill_step": 16}
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One rank, prefix cache off, the same settings otherwise."""
    with Deployment(tmp_path_factory.mktemp("ref"),
                    settings={**SETTINGS, "prompt_cache_entries": 0}) as d:
        yield d


def index_records(d: Deployment, rank: int) -> list[tuple]:
    recs = read_cache_index(cache_index_path(d.paths, d.deployment_id, rank))
    return [(r["seq"], r["step"], [tuple(e) for e in r["entries"]]) for r in recs]


def cached(r) -> int:
    return r.chunks[0].cached_tokens


def held(d: Deployment) -> dict[int, int]:
    """Rank 0's index now: entry id → tokens."""
    recs = index_records(d, 0)
    return dict(recs[-1][2]) if recs else {}


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_prefix_cache_matches_cache_off(mode, reference, tmp_path):
    ref = reference
    with Deployment(tmp_path, mode=mode, settings=SETTINGS,
                    rank_env={0: {"LOCKSTEP_TEST_STEP_DELAY_S": "0.02"}}) as d:
        # 1. A miss: nothing held yet.
        a = words(1, 120)
        ra = d.generate(a, max_tokens=12)
        assert cached(ra) == 0
        assert ra.tokens == ref.generate(a, max_tokens=12).tokens

        # 2. The next turn: a partial-prefix hit covering the prompt and the reply.
        b = a + ra.tokens + words(2, 40)
        rb = d.generate(b, max_tokens=12)
        assert cached(rb) == len(a) + len(ra.tokens)
        ref_b = ref.generate(b, max_tokens=12)
        assert rb.tokens == ref_b.tokens

        # 3. The whole prompt is held (b + its reply): only its last token is computed.
        rb2 = d.generate(b, max_tokens=12)
        assert cached(rb2) == len(b) - 1
        assert rb2.tokens == ref_b.tokens

        # 4. A hit on an entry that concurrent inserts evict while the request runs.
        before = held(d)
        c = b + rb.tokens + words(3, 30)
        rid_c = d.submit(c, max_tokens=40)
        d.wait_tokens(rid_c, 1)
        others = [d.submit(words(10 + i, 60), max_tokens=2) for i in range(3)]
        for rid in others:
            d.result(rid)
        rc = d.result(rid_c)
        after = held(d)
        assert cached(rc) > len(b)
        assert not set(before) & set(after), (before, after)  # all evicted meanwhile
        gone_at = next(step for _, step, entries in index_records(d, 0)
                       if not set(before) & {e for e, _ in entries})
        left_at = next(x["step"] for x in d.removals(0) if x["request_id"] == rid_c)
        assert gone_at < left_at  # evicted while the request it served still ran
        assert rc.tokens == ref.generate(c, max_tokens=40).tokens

        # 5. An abort mid-prefill stores nothing; the prompt later misses and matches.
        f = words(4, 600)
        for _attempt in range(3):
            records = len(index_records(d, 0))
            rid_f = d.submit(f, max_tokens=8)
            poll_until(lambda: d.stats().active, 10, "the long prompt in the batch")
            d.abort(rid_f)
            rf = d.result(rid_f)
            if not rf.tokens:
                break  # it left the batch before its first token: mid-prefill
        assert rf.finish_reason == "abort" and rf.tokens == []
        assert len(index_records(d, 0)) == records  # the index never changed for it
        rf2 = d.generate(f, max_tokens=8)
        assert cached(rf2) == 0
        assert rf2.tokens == ref.generate(f, max_tokens=8).tokens

        # 6. A cancel epoch removes a request inserted from cache, on every rank alike.
        g = f + rf2.tokens + words(5, 20)
        rid_g = d.submit(g, max_tokens=200)
        d.wait_tokens(rid_g, 3)
        epoch = d.cancel("requests", [rid_g])
        acks = d.wait_acks(epoch)
        assert len({a.step_applied for a in acks.values()}) == 1
        assert all(a.cancelled == [rid_g] for a in acks.values())
        rg = d.result(rid_g)
        assert rg.finish_reason == "abort" and cached(rg) > len(f)
        removed = {r: next(x for x in d.removals(r) if x["request_id"] == rid_g)
                   for r in range(2)}
        assert removed[0]["reason"] == removed[1]["reason"] == "cancel"
        assert removed[0]["step"] == removed[1]["step"]
        assert removed[0]["tokens_sha"] == removed[1]["tokens_sha"]

        # 7. Seeded sampling from cache: the same tokens on every rank and as cache-off.
        h = g[:-20] + words(6, 25)
        rh = d.generate(h, max_tokens=16, temperature=0.9, seed=1234)
        assert cached(rh) >= len(f)
        assert rh.tokens == ref.generate(h, max_tokens=16, temperature=0.9, seed=1234).tokens

        # 8. Three requests sharing a new 200-token prefix at once: one prefill, which the
        #    other two wait for and start from (a live store of its prompt's KV).
        shared = words(7, 200)
        prompts = [shared + words(20 + i, 5) for i in range(3)]
        rids = [d.submit(p, max_tokens=6) for p in prompts]
        rs = [d.result(rid) for rid in rids]
        assert [cached(r) for r in rs] == [0, len(shared), len(shared)]
        assert d.stub.batches > 0  # concurrent streams' chunks came one message a step
        for p, r in zip(prompts, rs, strict=True):
            assert r.tokens == ref.generate(p, max_tokens=6).tokens

        # Every rank applied every cache decision at the same plan, and every request's
        # tokens agree across ranks.
        d.wait(lambda: index_records(d, 1) == index_records(d, 0), 10, "follower index")
        assert len(index_records(d, 0)) >= 6
        digests = [{x["request_id"]: (x["step"], x["tokens_sha"]) for x in d.removals(r)}
                   for r in range(2)]
        assert digests[0] == digests[1]
        t0, t1 = d.fresh_telemetry(0).cache, d.fresh_telemetry(1).cache
        assert (t0.entries, t0.tokens, t0.stored, t0.evicted) == \
            (t1.entries, t1.tokens, t1.stored, t1.evicted)
        assert t0.hits >= 5 and t0.misses >= 3
