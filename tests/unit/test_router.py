"""The replica router's rule (services/gateway/core/router.py) and the approximate index
(services/gateway/core/route_index.py), on plain backends: the rule is a pure function of
each replica's streams, its index and the routed counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from services.gateway.core.route_index import RoutedIndex
from services.gateway.core.router import DECODE_COST, Reason, Router, load


@dataclass
class Stream:
    route_len: int  # the prompt (a continuation's: prompt + its output so far)
    first_token_at: float | None = None
    route_cached: int = 0


@dataclass
class Replica:
    deployment_id: str
    streams: dict[str, Stream] = field(default_factory=dict)

    def run(self, prompt_len: int, *, decoding: bool = False, cached: int = 0) -> None:
        self.streams[f"r{len(self.streams)}"] = Stream(prompt_len, 1.0 if decoding else None,
                                                       cached)


def prompt(i: int, n: int = 300) -> list[int]:
    return [1000 + i] + list(range(n))  # distinct from the first token on


def test_equal_loads_alternate_instead_of_piling_onto_the_first():
    a, b = Replica("d-a"), Replica("d-b")
    r = Router(imbalance=4096)
    got = Counter(r.choose([a, b], prompt(i)).backend.deployment_id for i in range(16))
    assert got == {"d-a": 8, "d-b": 8}
    # the list's order does not matter either
    r2 = Router(imbalance=4096)
    got2 = [r2.choose([b, a], prompt(i)).backend.deployment_id for i in range(4)]
    assert got2 == ["d-a", "d-b", "d-a", "d-b"]


def test_a_conversation_goes_back_to_the_replica_that_holds_its_prefix():
    a, b = Replica("d-a"), Replica("d-b")
    r = Router(imbalance=4096)
    first = r.choose([a, b], prompt(1))
    r.finished(first.backend, prompt(1) + [7, 8, 9])  # its reply is cached there too
    nxt = r.choose([a, b], prompt(1) + [7, 8, 9, 42, 43])
    assert nxt.backend is first.backend and nxt.reason is Reason.CACHE
    assert nxt.cached == len(prompt(1)) + 3
    for turn in range(3):  # the other replica is idle: still the cache wins, within the bound
        nxt = r.choose([a, b], prompt(1) + [7, 8, 9, 42, 43] + [50] * (turn + 1))
        assert nxt.backend is first.backend and nxt.reason is Reason.CACHE


def test_past_the_imbalance_bound_the_least_loaded_takes_it():
    a, b = Replica("d-a"), Replica("d-b")
    r = Router(imbalance=1000)
    first = r.choose([a, b], prompt(1)).backend
    other = b if first is a else a
    first.run(5000)  # a long prompt queued there: 5000 > 0 + 1000
    route = r.choose([a, b], prompt(1) + [5, 6])
    assert route.backend is other and route.reason is Reason.IMBALANCED


def test_load_counts_queued_prompt_tokens_not_requests():
    a, b = Replica("d-a"), Replica("d-b")
    a.run(3000)  # one request, prefilling 3000 tokens
    for _ in range(3):
        b.run(100, decoding=True)  # three decoding
    assert load(a) == 3000 and load(b) == 3 * DECODE_COST
    assert Router(imbalance=4096).choose([a, b], prompt(9)).backend is b
    a.streams.clear()
    a.run(3000, cached=2900)  # its cache holds most of it: 100 to compute
    assert load(a) == 100


def test_one_replica_is_chosen_with_its_cached_prefix():
    a = Replica("d-a")
    r = Router(imbalance=0)
    r.choose([a], prompt(3))
    route = r.choose([a], prompt(3) + [1])
    assert route.reason is Reason.ONLY and route.cached == len(prompt(3))


def test_the_precise_index_is_read_where_the_backend_has_one():
    class Held:
        def longest_prefix(self, ids):
            return len(ids) - 1

    a, b = Replica("d-a"), Replica("d-b")
    b.cache_index = Held()
    route = Router(imbalance=4096, index="precise").choose([a, b], prompt(5))
    assert route.backend is b and route.reason is Reason.CACHE
    with pytest.raises(ValueError, match="route_index"):
        Router(imbalance=1, index="exact")


def test_routed_index_matches_as_rank_0_does():
    ix = RoutedIndex(max_entries=2)
    assert ix.longest_prefix([1, 2, 3]) == 0
    ix.add([1, 2, 3])
    assert ix.longest_prefix([1, 2, 3]) == 2  # the last prompt token is always computed
    assert ix.longest_prefix([1, 2, 3, 4]) == 3
    ix.add([1, 2, 3, 4, 5])  # extends the first: it replaces it
    assert len(ix) == 1
    ix.add([1, 2])  # held already (a prefix of an entry): nothing new
    assert len(ix) == 1
    ix.add([9, 9, 9])
    ix.add([8, 8, 8])  # over the bound: the least recent goes
    assert len(ix) == 2 and ix.longest_prefix([1, 2, 3, 4, 5, 6]) == 0


def test_a_shared_template_prefix_does_not_pull_distinct_prompts_onto_one_replica():
    a, b = Replica("d-a"), Replica("d-b")
    r = Router(imbalance=1024)
    template = list(range(5000, 5030))  # a chat template's 30 shared tokens

    def distinct(i: int) -> list[int]:
        return [*template, *range(10_000 + 1000 * i, 10_000 + 1000 * i + 300)]

    routes = [r.choose([a, b], distinct(i)) for i in range(16)]  # one at a time: loads 0
    assert Counter(x.backend.deployment_id for x in routes) == {"d-a": 8, "d-b": 8}
    assert {x.reason for x in routes} == {Reason.LOAD}


def test_round_robin_goes_in_turn_whatever_the_cache():
    a, b = Replica("d-a"), Replica("d-b")
    r = Router(imbalance=1024, policy="round_robin")
    got = [r.choose([a, b], prompt(1)).backend.deployment_id for _ in range(4)]
    assert got == ["d-a", "d-b", "d-a", "d-b"]
    with pytest.raises(ValueError, match="route_policy"):
        Router(imbalance=1, policy="random")
