"""Rank 0's prefix-cache decisions, as pure functions of what it was told."""

from __future__ import annotations

from common.messages import CacheOpKind
from services.rank.prefix_cache import MIN_HIT_TOKENS, CachePlanner


def ops(p: CachePlanner) -> list[tuple]:
    return [(o.kind.value, o.entry_id, o.request_id) for o in p.take_ops()]


def test_miss_then_hits_capped_before_the_last_prompt_token():
    p = CachePlanner(max_entries=4, max_bytes=10_000, trimmable=True)
    prompt = list(range(100, 140))
    assert p.match(prompt) == (0, 0)
    p.finished("a", prompt + [7, 8], nbytes=42)
    assert ops(p) == [("store", 1, "a")]
    assert p.match(prompt) == (1, len(prompt) - 1)  # the whole prompt held: one computed
    assert p.match(prompt + [7, 8, 9]) == (1, len(prompt) + 2)  # prompt + reply
    assert p.match(prompt[:20] + [1, 2, 3]) == (1, 20)  # cut to the shared prefix
    assert p.match(list(range(MIN_HIT_TOKENS - 1)) + [5]) == (0, 0)
    assert (p.hits, p.misses) == (3, 2)


def test_untrimmable_caches_hit_only_whole_entries():
    p = CachePlanner(max_entries=4, max_bytes=10_000, trimmable=False)
    base = list(range(100, 140))
    p.finished("a", base, nbytes=1)
    p.take_ops()
    assert p.match(base[:30] + [1]) == (0, 0)  # it would have to be cut
    assert p.match(base) == (0, 0)  # so would a whole-prompt hit
    assert p.match(base + [1, 2]) == (1, len(base))


def test_a_store_evicts_the_entries_it_extends_then_lru_by_count_and_bytes():
    p = CachePlanner(max_entries=2, max_bytes=100, trimmable=True)
    t1 = list(range(100, 120))
    p.finished("a", t1, nbytes=10)
    p.finished("b", t1 + [1, 2, 3], nbytes=12)  # extends a: a goes
    assert ops(p) == [("store", 1, "a"), ("evict", 1, ""), ("store", 2, "b")]
    p.finished("c", list(range(300, 330)), nbytes=10)
    p.match(t1 + [1, 2])  # b used: c is now the least recent
    p.finished("d", list(range(500, 530)), nbytes=10)
    assert ops(p) == [("store", 3, "c"), ("evict", 3, ""), ("store", 4, "d")]
    p.finished("e", list(range(700, 760)), nbytes=95)  # bytes: both others must go
    assert ops(p) == [("evict", 2, ""), ("evict", 4, ""), ("store", 5, "e")]
    p.finished("huge", list(range(900, 960)), nbytes=101)  # more than the whole budget
    assert ops(p) == [] and p.not_stored == 1
    assert list(p.index) == [5] and p.nbytes == 95


def test_the_next_agent_turn_supersedes_the_last_but_a_branch_keeps_its_own_entry():
    """An agent's next turn resends its reply re-tokenized: the previous entry (prompt +
    reply as generated) is not a prefix of the new one, only shares all but its last few
    tokens. The new entry serves its prompts (trimmed): the previous one is evicted, not
    held as a second copy of the conversation. A conversation that branched earlier
    (more than SUPERSEDE_SLACK or an eighth of the entry before its end) keeps its own."""
    p = CachePlanner(max_entries=8, max_bytes=10**9, trimmable=True)
    prompt = list(range(1000, 1000 + 3000))
    turn1 = prompt + list(range(20, 44))  # 24 generated tokens
    p.finished("t1", turn1, nbytes=10)
    turn2 = prompt + list(range(20, 27)) + [9] * 300 + list(range(50, 74))  # diverges at 7
    p.finished("t2", turn2, nbytes=10)
    assert ops(p) == [("store", 1, "t1"), ("evict", 1, ""), ("store", 2, "t2")]
    assert p.match(turn1 + [5]) == (2, len(prompt) + 7)  # served by turn 2's entry
    branch = prompt[:2000] + [8] * 1500  # shares 2000 of turn 2's 3331 tokens
    p.finished("b", branch, nbytes=10)
    assert ops(p) == [("store", 3, "b")]
    short = list(range(100, 160))  # an eighth of 60 tokens: 7 may differ at its end
    p.finished("s1", short, nbytes=1)
    p.finished("s2", short[:52] + [1] * 30, nbytes=1)  # 8 differ: both kept
    assert [k for k, _, _ in ops(p)] == ["store", "store"]


def test_the_same_tokens_are_stored_once_and_clear_replaces_pending_ops():
    p = CachePlanner(max_entries=4, max_bytes=100, trimmable=True)
    t = list(range(100, 120))
    p.finished("a", t, nbytes=5)
    p.take_ops()
    p.finished("again", t, nbytes=5)
    assert ops(p) == []
    p.finished("b", list(range(200, 220)), nbytes=5)
    p.request_clear(7)
    assert [o.kind for o in p.take_ops()] == [CacheOpKind.CLEAR]
    assert p.take_cleared() == [7] and p.take_cleared() == []
    assert p.match(t) == (0, 0) and p.nbytes == 0


def test_a_request_waits_for_a_running_prefill_it_shares_and_never_for_nothing():
    from services.rank.prefix_cache import SHARE_TOKENS, WAIT

    p = CachePlanner(max_entries=4, max_bytes=10_000, trimmable=True)
    shared = list(range(100, 100 + 2 * SHARE_TOKENS))
    assert p.plan_insert("a", shared + [1]) == (0, 0)  # a miss: a prefills
    assert p.plan_insert("b", shared + [2]) == (WAIT, 0)  # shares a's prefill
    assert p.plan_insert("c", list(range(900, 1000))) == (0, 0)  # shares nothing
    assert p.first_token("a") is True  # b waits: store a's prompt KV live
    p.finished("a", shared + [1, 7], nbytes=10, live=True)
    [op] = p.take_ops()
    assert op.live and op.request_id == "a"
    assert p.plan_insert("b", shared + [2]) == (op.entry_id, len(shared))
    # A request waited on that leaves before its first token releases its waiters.
    assert p.plan_insert("d", list(range(3000, 3200))) == (0, 0)
    assert p.plan_insert("e", list(range(3000, 3200)) + [5]) == (WAIT, 0)
    p.left("d")
    assert p.plan_insert("e", list(range(3000, 3200)) + [5]) == (0, 0)
    assert p.first_token("c") is False  # nobody waited for c
