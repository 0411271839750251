"""Rank 0's drafts (issue 46): before each step, every decoding request that speculates
gets up to `k` tokens guessed by prompt lookup (services/rank/ngram_drafts.py) over its
prompt, its tokens so far and the token the last step drew (mlx-lm runs one step ahead:
that token is fed by the next step, the drafts follow it). The plan carries them; every
rank verifies them in that step (services/rank/spec_step.py), so what a request emits
is plain decoding's whatever was proposed.

A test proposer stands behind the same seam (`ReplayDrafts`, LOCKSTEP_TEST_DRAFTS_P with
the rank's test seams on): it proposes what an earlier request with the same prompt and
sampling emitted, each draft right with probability p (else another token), so the
tests can choose how often drafts are right on any model.

Counts for /metrics: verify steps (a step with some drafts), drafts proposed, drafts
accepted (tokens a drafting row emitted past the one a plain step emits).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import replace

from common.messages import PlanInsert, SpecStats
from services.rank.engine import Emitted, Engine
from services.rank.ngram_drafts import NgramIndex

DRAFTS = 4  # drafts per request per step at most


class ReplayDrafts:
    """The test proposer: continuations of finished requests by (prompt, seed if
    sampled), proposed right with probability `p` each (a wrong one is another id)."""

    def __init__(self, p: float, vocab: int) -> None:
        self.p, self.vocab = p, vocab
        self.seen: dict[tuple, list[int]] = {}

    @staticmethod
    def key(ins: PlanInsert) -> tuple:
        s = ins.sampling
        original = ins.prompt[:len(ins.prompt) - ins.resumed]  # a continuation's own
        return tuple(original), s.seed if s.temperature > 0 else None, s.grammar

    def remember(self, ins: PlanInsert, tokens: list[int]) -> None:
        self.seen[self.key(ins)] = [*ins.prompt[len(ins.prompt) - ins.resumed:], *tokens]

    def propose(self, ins: PlanInsert, rid: str, known: list[int], k: int) -> list[int] | None:
        """Up to k drafts after `known` (the request's output so far, the drawn token
        included); None: no earlier run of it to replay."""
        truth = self.seen.get(self.key(ins))
        if truth is None:
            return None
        drawn_at = ins.resumed + len(known) - 1  # the drawn token's index in the output
        out = []
        for j in range(drawn_at + 1, min(drawn_at + 1 + k, len(truth))):
            rng = random.Random(f"{rid}:{j}")
            right = truth[j]
            out.append(right if rng.random() < self.p
                       else (right + 1 + rng.randrange(self.vocab - 1)) % self.vocab)
        return out


class Proposer:
    def __init__(self, k: int = DRAFTS, replay: ReplayDrafts | None = None) -> None:
        self.k, self.replay = k, replay
        self.index: dict[str, NgramIndex] = {}  # request id -> its tokens' grams
        self.counts = SpecStats()  # replaced, never changed: telemetry holds the last
        self._drafted: dict[str, int] = {}  # this step's drafting requests: drafts each

    def drafts(self, engine: Engine, leaving: Collection[str],
               insert_of: Callable[[str], PlanInsert | None]) -> dict[str, list[int]]:
        """The next step's drafts: request id -> tokens, for the decoding requests not
        `leaving` in this plan that speculate (`Sampling.speculative`) and that the index
        can guess for."""
        out: dict[str, list[int]] = {}
        for rid, drawn in engine.next_tokens().items():
            ins = None if rid in leaving else insert_of(rid)  # None: no longer scheduled
            if ins is None or not ins.sampling.speculative:
                continue
            a = engine.by_rid[rid]
            known = [*a.tokens, drawn]  # after the prompt (a continuation's included)
            d = None if self.replay is None else self.replay.propose(ins, rid, known, self.k)
            if d is None:
                idx = self.index.get(rid)
                if idx is None:
                    idx = self.index[rid] = NgramIndex(ins.prompt)
                idx.extend(known[len(idx) - a.prompt_len:])
                d = idx.propose(self.k)
            if d:
                out[rid] = d
        for rid in [r for r in self.index if not engine.has(r)]:
            del self.index[rid]
        self._drafted = {rid: len(d) for rid, d in out.items()}
        if out:
            c = self.counts
            self.counts = replace(c, verify_steps=c.verify_steps + 1,
                                  verify_rows=c.verify_rows + len(out),
                                  proposed=c.proposed + sum(self._drafted.values()))
        return out

    def observe(self, emitted: list[Emitted]) -> None:
        """The step's emissions: a drafting request's tokens past one were accepted drafts
        (a stop token ending the row counts: it was drawn where a draft stood)."""
        per: dict[str, int] = {}
        for e in emitted:
            rid = e.active.request_id
            if rid in self._drafted:
                per[rid] = per.get(rid, 0) + 1
        if per:
            self.counts = replace(self.counts, accepted=self.counts.accepted
                                  + sum(n - 1 for n in per.values()))
        self._drafted = {}
