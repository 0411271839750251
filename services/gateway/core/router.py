"""Routing between replicas: which serving deployment of a model takes a request.

The rule, per request (after tokenizing: the prompt's tokens decide):
1. Load of a replica, in prefill-token equivalents: the uncached prompt tokens of its
   requests still waiting for their first token, plus DECODE_COST per request decoding.
   Requests alone would be blind to one replica holding a queue of long prompts, and
   tokens alone blind to a replica busy decoding many short ones.
2. Each replica's cached prefix of this prompt, from its prefix index: the precise one
   (rank 0's own cache events, cache_index.py) where the backend has it and it is
   chosen, else the approximate one (what this gateway routed where, route_index.py).
3. The replica with the longest cached prefix takes it — if that saves something: it
   holds at least MIN_GAIN more of the prompt than the replica holding least (a chat
   template's or a default system prompt's few shared tokens must not pull every new
   conversation onto one replica: SGLang's cache_threshold guards the same thing with a
   share of the prompt, which a short conversation's second turn fails) —
   unless its load exceeds the least loaded replica's by more than `imbalance`: then the
   least loaded takes it (the cache would save less than the queue costs), preferring,
   among the least loaded, a longer cached prefix. Without a useful match: least loaded.
4. Ties on load break by how many requests each was routed (then id), never by list
   order: equal loads must not pile onto the first replica, which its index would then
   reinforce (the failure SGLang's and vLLM's routers had; peer-notes B).
The choice is made with no await before the streams register on the backend, so
concurrent requests see each other's load.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.core.request_channel import Backend
from services.gateway.core.route_index import RoutedIndex

DECODE_COST = 128  # prefill tokens one decoding request weighs (a step of the batch each)
MIN_GAIN = 32  # tokens: less is a shared template's worth, not a conversation's
INDEXES = ("approx", "precise")
POLICIES = ("cache", "round_robin")  # round_robin: the baseline the bench compares with


class Reason(enum.Enum):
    ONLY = "only"  # one replica serves the model
    CACHE = "cache"  # the longest cached prefix, within the imbalance bound
    IMBALANCED = "imbalanced"  # a cache match, but its replica was too loaded
    LOAD = "load"  # no useful match: least loaded
    ROUND_ROBIN = "round_robin"  # route_policy round_robin: in turn, whatever the cache


@dataclass(frozen=True)
class Route:
    backend: Backend
    cached: int  # prompt tokens the index expects its cache to hold
    reason: Reason


def load(b: Backend) -> int:
    pending = decoding = 0
    for s in b.streams.values():
        if s.first_token_at is None:
            pending += max(0, s.route_len - s.route_cached)
        else:
            decoding += 1
    return pending + DECODE_COST * decoding


class Router:
    def __init__(self, imbalance: int, index: str = "approx", metrics: Any = None,
                 policy: str = "cache") -> None:
        if index not in INDEXES:
            raise ValueError(f"route_index: must be one of {', '.join(INDEXES)}")
        if policy not in POLICIES:
            raise ValueError(f"route_policy: must be one of {', '.join(POLICIES)}")
        self.imbalance, self.index_kind, self.metrics = imbalance, index, metrics
        self.policy = policy
        self.routed: collections.Counter[str] = collections.Counter()  # by deployment
        self.approx: dict[str, RoutedIndex] = {}

    def index_of(self, b: Backend):
        precise = getattr(b, "cache_index", None)
        if self.index_kind == "precise" and precise is not None:
            return precise
        return self.approx.setdefault(b.deployment_id, RoutedIndex())

    def choose(self, cands: Sequence[Backend], ids: Sequence[int]) -> Route:
        if len(cands) == 1:
            route = Route(cands[0], self.index_of(cands[0]).longest_prefix(ids), Reason.ONLY)
        elif self.policy == "round_robin":
            b = min(cands, key=lambda b: (self.routed[b.deployment_id], b.deployment_id))
            route = Route(b, self.index_of(b).longest_prefix(ids), Reason.ROUND_ROBIN)
        else:
            route = self._choose(cands, ids)
        self.routed[route.backend.deployment_id] += 1
        self.approx.setdefault(route.backend.deployment_id, RoutedIndex()).add(ids)
        if self.metrics is not None:
            self.metrics.routes.labels(deployment=route.backend.deployment_id,
                                       reason=route.reason.value).inc()
        return route

    def _choose(self, cands: Sequence[Backend], ids: Sequence[int]) -> Route:
        loads = {b.deployment_id: load(b) for b in cands}
        match = {b.deployment_id: self.index_of(b).longest_prefix(ids) for b in cands}

        def calm(b: Backend) -> tuple:  # least loaded, then fewest routed, then id
            return loads[b.deployment_id], self.routed[b.deployment_id], b.deployment_id

        best = min(cands, key=lambda b: (-match[b.deployment_id], *calm(b)))
        least = min(loads.values())
        if match[best.deployment_id] - min(match.values()) < MIN_GAIN:
            b = min(cands, key=calm)
            return Route(b, match[b.deployment_id], Reason.LOAD)
        if loads[best.deployment_id] - least <= self.imbalance:
            return Route(best, match[best.deployment_id], Reason.CACHE)
        floor = [b for b in cands if loads[b.deployment_id] == least]
        b = min(floor, key=lambda b: (-match[b.deployment_id], *calm(b)))
        return Route(b, match[b.deployment_id], Reason.IMBALANCED)

    def finished(self, b: Backend, tokens: Sequence[int]) -> None:
        """A request the model ended (stop, length) left prompt + output in rank 0's
        cache: the approximate index records it too."""
        self.approx.setdefault(b.deployment_id, RoutedIndex()).add(tokens)

    def forget(self, deployment_id: str) -> None:
        """A deployment gone: what was routed there is in no cache any more."""
        self.approx.pop(deployment_id, None)
        self.routed.pop(deployment_id, None)
