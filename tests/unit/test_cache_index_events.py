"""Rank 0's prefix-cache index as events (services/rank/cache_events.py, cache_feed.py)
and the gateway's precise index fed by them (services/gateway/core/cache_index.py): after
every plan's ops, the index built from the events equals the planner's, entry for entry
and token for token — stores, extensions of a conversation, LRU and budget evictions,
clears, live stores — and a lost message shows as a gap that a snapshot repairs. Sizes
stay under the envelope's cap; forged, replayed and wrong-way messages are rejected."""

from __future__ import annotations

import random

import pytest
import zmq

from common import messages as m
from common.bus import Channel
from common.envelope import DEFAULT_MAX_SIZE, Key, Reason
from common.messages.cache_events import ENTRY_TOKENS, MESSAGE_TOKENS
from common.schema import decode_into
from services.gateway.core.cache_index import PreciseIndex
from services.rank import cache_events
from services.rank.cache_events import CacheEventLog
from services.rank.cache_feed import MAX_SUBSCRIBERS, CacheFeed
from services.rank.prefix_cache import CachePlanner
from tests.support.bus import KEY

OTHER_KEY = Key.from_secret(b"f" * 32)

ENTRY_BYTES = 100


def planner(entries: int = 4, trimmable: bool = True) -> CachePlanner:
    return CachePlanner(entries, entries * 10 * ENTRY_BYTES, trimmable)


class Pipe:
    """Planner → events → messages → a PreciseIndex, as rank 0 and a gateway do."""

    def __init__(self, p: CachePlanner) -> None:
        self.p, self.log, self.index = p, CacheEventLog(), PreciseIndex()
        self.index.apply(self.log.snapshot()[0])  # subscribed before anything happened
        self.sent: list[m.CacheEvents] = []

    def plan(self, deliver: bool = True) -> list[m.CacheEvent]:
        ops = self.p.take_ops()
        events = self.log.on_ops(ops, self.p.taken_tokens)
        msgs = list(self.log.messages(events))
        self.sent += msgs
        if deliver:
            for msg in msgs:
                assert self.index.apply(msg)
        return events

    def check(self) -> None:
        want = {eid: e.tokens for eid, e in self.p.index.items()}
        assert self.index.view() == {eid: len(t) for eid, t in want.items()}
        for eid, t in want.items():
            assert self.index.entries[eid].tokens.tolist() == t[:ENTRY_TOKENS].tolist()
        assert self.log.entries.keys() == want.keys()


def toks(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(5, 1000) for _ in range(n)]


def test_a_conversation_extends_its_entry_with_only_the_new_tokens():
    pipe = Pipe(planner())
    turn1 = toks(1, 40)
    pipe.p.finished("r-1", turn1, ENTRY_BYTES)
    [added] = pipe.plan()
    assert (added.seq, added.kind, added.entry_id, added.n_tokens, added.request_id) == \
        (1, m.CacheEventKind.ADDED, 1, 40, "r-1")
    pipe.check()
    turn2 = turn1 + toks(2, 25)
    pipe.p.finished("r-2", turn2, ENTRY_BYTES)
    [ext] = pipe.plan()  # not EVICTED + ADDED: one event, the suffix only
    assert (ext.seq, ext.kind, ext.entry_id, ext.base_id) == (2, m.CacheEventKind.EXTENDED, 2, 1)
    assert ext.tokens == turn2[40:] and ext.n_tokens == 65
    pipe.check()
    assert pipe.index.longest_prefix(turn2 + [7, 8]) == 65
    assert pipe.index.longest_prefix(turn2) == 64  # capped at len - 1, as rank 0 matches
    assert pipe.index.longest_prefix(toks(9, 30)) == 0
    assert pipe.index.stored_at.keys() == {"r-1", "r-2"}


def test_evictions_clears_and_live_stores_leave_equal_indexes_after_every_plan():
    pipe = Pipe(planner(entries=3))
    kinds: set = set()
    for i in range(6):  # six distinct prompts through a 3-entry budget: LRU evictions
        pipe.p.finished(f"r-{i}", toks(10 + i, 20 + i), ENTRY_BYTES)
        kinds |= {e.kind for e in pipe.plan()}
        pipe.check()
    pipe.p.finished("live", toks(30, 80), ENTRY_BYTES, live=True)  # a prefill others await
    pipe.p.finished("done", toks(30, 80) + toks(31, 12), ENTRY_BYTES)  # then it finishes
    kinds |= {e.kind for e in pipe.plan()}
    pipe.check()
    pipe.p.request_clear(7)
    pipe.p.finished("after-clear", toks(40, 33), ENTRY_BYTES)  # same plan, after the CLEAR
    events = pipe.plan()
    assert [e.kind for e in events] == [m.CacheEventKind.CLEARED, m.CacheEventKind.ADDED]
    pipe.check()
    assert kinds == {m.CacheEventKind.ADDED, m.CacheEventKind.EVICTED, m.CacheEventKind.EXTENDED}
    assert [e.seq for msg in pipe.sent for e in msg.events] == \
        list(range(1, pipe.log.seq + 1))  # one sequence, nothing skipped


@pytest.mark.parametrize("trimmable", [True, False])
def test_random_sequences_of_plans_keep_the_gateway_index_equal_to_the_planner(trimmable):
    rng = random.Random(5)
    pipe = Pipe(planner(entries=5, trimmable=trimmable))
    convs: list[list[int]] = []
    for step in range(300):
        for _ in range(rng.randrange(0, 4)):  # 0..3 finishes per step
            r = rng.random()
            if convs and r < 0.6:  # a conversation's next turn
                c = rng.randrange(len(convs))
                convs[c] = convs[c] + toks(step * 10 + c, rng.randrange(1, 30))
                t = convs[c]
            elif convs and r < 0.7:  # a shorter prompt sharing a prefix
                t = rng.choice(convs)[:rng.randrange(1, 20)] + toks(step, 5)
            else:
                t = toks(1000 + step, rng.randrange(5, 60))
                convs.append(t)
            pipe.p.finished(f"r-{step}-{r}", t, ENTRY_BYTES * rng.randrange(1, 12),
                            live=rng.random() < 0.1)
        if rng.random() < 0.02:
            pipe.p.request_clear()
        pipe.plan()
        pipe.check()
    assert pipe.index.applied == pipe.log.seq and pipe.index.gaps == 0


def test_a_lost_message_is_a_gap_and_a_snapshot_resyncs():
    pipe = Pipe(planner())
    pipe.p.finished("a", toks(1, 30), ENTRY_BYTES)
    pipe.plan()
    pipe.p.finished("b", toks(2, 30), ENTRY_BYTES)
    pipe.plan(deliver=False)  # lost on the way (a full pipe)
    pipe.p.finished("c", toks(1, 30) + toks(3, 9), ENTRY_BYTES)
    pipe.plan(deliver=False)
    ok = pipe.index.apply(pipe.sent[-1])
    assert not ok and pipe.index.gaps == 1 and not pipe.index.synced
    # while out of step, later events are dropped, not applied on a wrong base
    pipe.p.finished("d", toks(4, 30), ENTRY_BYTES)
    pipe.plan(deliver=False)
    assert not pipe.index.apply(pipe.sent[-1]) and pipe.index.stale == 1
    for part in pipe.log.snapshot():  # what the re-subscribe brings
        assert pipe.index.apply(part)
    assert pipe.index.synced and pipe.index.resyncs == 2 and pipe.index.seq == pipe.log.seq
    pipe.check()
    assert pipe.index.apply(pipe.sent[-1]) and pipe.index.stale == 2  # a late duplicate
    pipe.p.finished("e", toks(5, 30), ENTRY_BYTES)
    pipe.plan()
    pipe.check()


def test_another_origin_means_rank_0_restarted_and_asks_for_a_snapshot():
    pipe = Pipe(planner())
    pipe.p.finished("a", toks(1, 30), ENTRY_BYTES)
    pipe.plan()
    fresh = CacheEventLog()  # a new rank 0 process: ids and sequence start afresh
    p2 = planner()
    p2.finished("x", toks(7, 12), ENTRY_BYTES)
    [msg] = fresh.messages(fresh.on_ops(p2.take_ops(), p2.taken_tokens))
    assert not pipe.index.apply(msg) and pipe.index.gaps == 1
    for part in fresh.snapshot():
        pipe.index.apply(part)
    assert pipe.index.origin == fresh.origin and pipe.index.view() == {1: 12}


def test_big_entries_are_capped_and_big_snapshots_come_in_parts(monkeypatch):
    pipe = Pipe(CachePlanner(8, 10**9, True))
    big = toks(1, ENTRY_TOKENS + 500)
    pipe.p.finished("big", big, ENTRY_BYTES)
    [ev] = pipe.plan()
    assert len(ev.tokens) == ENTRY_TOKENS and ev.n_tokens == len(big)
    pipe.p.finished("bigger", big + [3, 4, 5], ENTRY_BYTES)
    [ext] = pipe.plan()
    assert ext.kind is m.CacheEventKind.EXTENDED and ext.tokens == [] and ext.n_tokens == len(big) + 3
    pipe.check()
    assert pipe.index.longest_prefix(big + [3, 4, 5, 6]) == ENTRY_TOKENS  # what it knows
    # The biggest message that can be made, with the biggest token ids, fits the cap.
    huge = m.CacheEvents("cache-index", "o" * 16, [
        m.CacheEvent(1 << 40, m.CacheEventKind.ADDED, 1 << 40, 0, [2**32 - 1] * ENTRY_TOKENS,
                     1 << 40, "r" * 64)] * (MESSAGE_TOKENS // ENTRY_TOKENS))
    assert len(Channel("t", "t", sender="rank", send_key=KEY).pack(huge)) < DEFAULT_MAX_SIZE
    monkeypatch.setattr(cache_events, "MESSAGE_TOKENS", 100)
    log = CacheEventLog()
    p = CachePlanner(8, 10**9, True)
    for i in range(5):
        p.finished(f"r-{i}", toks(i, 60), ENTRY_BYTES)
    events = log.on_ops(p.take_ops(), p.taken_tokens)
    assert [len(msg.events) for msg in log.messages(events)] == [1, 1, 1, 1, 1]
    parts = log.snapshot()
    assert [(s.part, s.last, len(s.entries)) for s in parts] == \
        [(0, False, 1), (1, False, 1), (2, False, 1), (3, False, 1), (4, True, 1)]
    index = PreciseIndex()
    index.apply(parts[0])
    index.apply(parts[2])  # a part missing: that snapshot is not applied
    index.apply(parts[4])
    assert not index.synced
    for s in parts:
        index.apply(s)
    assert index.synced and index.view() == {i + 1: 60 for i in range(5)}


def test_the_feed_sends_a_snapshot_only_to_a_subscriber_behind_and_drops_gone_ones():
    sent: list[tuple[bytes, object]] = []
    status: dict[bytes, int] = {}

    def send(ident: bytes, data) -> int:
        sent.append((ident, data))
        return status.get(ident, 0)

    feed = CacheFeed(lambda body: body, send)
    p = planner()
    feed.on_subscribe(b"gw-1", m.CacheSubscribe())
    assert [type(d) for _, d in sent] == [m.CacheSnapshot]
    p.finished("a", toks(1, 20), ENTRY_BYTES)
    feed.on_ops(p.take_ops(), p.taken_tokens)
    assert isinstance(sent[-1][1], m.CacheEvents) and sent[-1][1].events[0].seq == 1
    n = len(sent)
    feed.on_subscribe(b"gw-1", m.CacheSubscribe(origin=feed.log.origin, seq=1))  # keep-alive
    assert len(sent) == n
    feed.on_subscribe(b"gw-1", m.CacheSubscribe(origin=feed.log.origin, seq=0))  # behind
    assert isinstance(sent[-1][1], m.CacheSnapshot) and feed.snapshots == 2
    status[b"gw-1"] = zmq.EAGAIN  # full: kept (it resyncs), counted
    feed.on_subscribe(b"gw-2", m.CacheSubscribe())
    status[b"gw-2"] = zmq.EHOSTUNREACH  # gone: dropped
    p.finished("b", toks(2, 20), ENTRY_BYTES)
    feed.on_ops(p.take_ops(), p.taken_tokens)
    assert list(feed.subscribers) == [b"gw-1"] and feed.unsent == 1
    for i in range(MAX_SUBSCRIBERS + 3):
        feed.on_subscribe(f"x-{i}".encode(), m.CacheSubscribe())
    assert len(feed.subscribers) == MAX_SUBSCRIBERS and b"gw-1" not in feed.subscribers


def test_forged_replayed_and_wrong_way_cache_messages_are_rejected_and_counted():
    rank = Channel("rank", "requests", sender="d/rank-0", send_key=KEY, accept=m.REQUESTS_IN)
    gw = Channel("gateway", "requests", sender="gateway", send_key=KEY, accept=m.REQUESTS_OUT)
    forger = Channel("x", "requests", sender="d/rank-0", send_key=OTHER_KEY)
    events = m.CacheEvents("cache-index", "o", [m.CacheEvent(1, m.CacheEventKind.CLEARED)])
    good = rank.pack(events)
    assert gw.unpack(good).body == events
    assert gw.unpack(good) is None  # replayed
    assert gw.unpack(forger.pack(events)) is None  # forged
    assert gw.unpack(rank.pack(m.CacheSubscribe())) is None  # a gateway never takes one
    assert rank.unpack(gw.pack(events)) is None  # nor rank 0 events
    assert rank.unpack(gw.pack(m.CacheSubscribe())).body == m.CacheSubscribe()
    counts = gw.rejects.snapshot()
    assert counts == {Reason.REPLAY.value: 1, Reason.UNKNOWN_KEY.value: 1,
                      Reason.UNEXPECTED_KIND.value: 1}
    too_many = {"request_id": "cache-index", "origin": "o",
                "events": [{"seq": 1, "kind": "cleared"}] * 513}
    with pytest.raises(Exception, match="field_too_large"):
        decode_into(m.CacheEvents, too_many)
