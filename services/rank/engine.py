"""The batch: an mlx-lm `BatchGenerator` driven only through step plans.

Every rank owns one `Engine` built from the same `RankSettings`, so the generators have
identical arguments, and applies exactly the same plans in the same order: removes, then
inserts (one `insert` call, in plan order), then `next()` iff the plan says advance.
Requests are named by request id; each rank maps id → uid from its own `insert` return
value and checks that the uid is the one the plan order predicts (an insert made on one
rank alone would shift every later uid). Any mismatch raises `Divergence`: the caller
fails closed instead of entering a collective its peers will not enter.

The prompt-cache store (services/rank/prefix_store.py) is part of the batch's state: a
plan's cache ops apply between its removes and its inserts, and an insert may start
from a stored entry (the plan says which, and how many of its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import psutil
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from common.messages import CacheOp, FinishReason, PlanInsert, PlanRemove
from common.rankspec import DEFAULT_PROMPT_CACHE_BYTES, RankSettings
from services.rank.disk_tier import DiskEntry, DiskTier
from services.rank.grammar import RankGrammars
from services.rank.prefix_store import CacheDivergence, PromptStore
from services.rank.sampling import logits_processors_for, sampler_for
from services.rank.spec_step import next_with_drafts


class Divergence(Exception):
    """This rank's batch no longer matches the plan: stop before the next collective."""


class CacheBudgetError(Exception):
    """This host cannot hold the prompt-cache budget every rank was given."""


def prompt_cache_budget(settings: RankSettings) -> int:
    return settings.prompt_cache_bytes or DEFAULT_PROMPT_CACHE_BYTES


@dataclass
class Active:
    request_id: str
    uid: int
    prompt_len: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)  # emitted tokens (stop token excluded)


@dataclass
class Finished:
    """One request leaving the batch: removed by a plan, or finished by the model."""

    active: Active
    reason: str  # FinishReason STOP | LENGTH (the model), or the plan's remove reason
    step: int  # the step it left at (removes: the step the plan precedes)
    token: int | None = None  # the token produced with a model finish, if emitted


@dataclass
class Emitted:
    active: Active
    token: int | None  # None: the stop token itself, which is not emitted
    finish_reason: FinishReason | None  # STOP or LENGTH: the model's own end
    logprobs: mx.array | None = None  # this step's row (rank 0 reads it if asked)


def generator_kwargs(settings: RankSettings) -> dict:
    """BatchGenerator arguments: a pure function of the settings, same on every rank.
    (No max_tokens: every insert carries its own, as the gateway decided it.)"""
    return {
        "completion_batch_size": settings.max_batch,
        "prefill_batch_size": settings.prefill_batch,
        "prefill_step_size": settings.prefill_step,
    }


class Engine:
    def __init__(self, model, eos_ids: list[int], settings: RankSettings,
                 grammars: RankGrammars | None = None, disk: DiskTier | None = None,
                 verified: dict[str, DiskEntry] | None = None) -> None:
        self.eos_ids = sorted(int(t) for t in eos_ids)
        self.grammars = grammars  # constrained decoding's matchers (None: no tokenizer)
        self.gen = BatchGenerator(model, stop_tokens=[[t] for t in self.eos_ids],
                                  **generator_kwargs(settings))
        self._default_stops = StopSequences([(t,) for t in self.eos_ids] or None)
        self.by_rid: dict[str, Active] = {}
        self.by_uid: dict[int, Active] = {}
        self.next_uid = 0
        self.step = 0  # next() calls made so far
        self.last_prompt_tokens = 0  # prompt tokens the last next() computed
        self.drafts: dict[str, list[int]] = {}  # the last plan's: what next() verifies
        self.store: PromptStore | None = None
        self.trimmable = can_trim_prompt_cache(make_prompt_cache(model))
        if settings.prompt_cache_entries > 0:
            budget = prompt_cache_budget(settings)
            total = psutil.virtual_memory().total
            if budget > total // 2:
                raise CacheBudgetError(
                    f"prompt_cache_bytes {budget} is more than half of this host's memory "
                    f"({total} bytes): lower it (or prompt_cache_entries 0 turns it off)")
            self.store = PromptStore(settings.prompt_cache_entries, budget, disk, verified)

    # -- queries -----------------------------------------------------------------

    def has(self, request_id: str) -> bool:
        return request_id in self.by_rid

    def has_work(self) -> bool:
        return bool(self.by_rid)

    def active_ids(self) -> tuple[str, ...]:
        return tuple(self.by_rid)

    def decoding(self) -> bool:
        """Some request in the batch has emitted a token (is past its prefill)."""
        return any(a.tokens for a in self.by_rid.values())

    def prefilling(self) -> list[int]:
        """Prompt tokens still to compute, per prompt inserted and not yet decoding (> 0
        only). Read off the generator's queues (mlx-lm 0.32 BatchGenerator): the last
        prompt token is its own segment, fed by the first decode step, so it is not
        counted."""
        g = self.gen
        left = [sum(len(s) for s in seq[1]) - 1 for seq in g._unprocessed_sequences]
        left += [sum(len(s) for s in p[0]) - 1 for p in g._currently_processing]
        return [n for n in left if n > 0]

    def prefill_sizes(self) -> list[int]:
        """Prompt tokens each prompt still in prefill had to compute when it started
        (read as `prefilling()` is): whether it is a long one does not change as it
        progresses."""
        g = self.gen
        sizes = [sum(len(s) for s in seq[1]) - 1 for seq in g._unprocessed_sequences]
        sizes += [p[2] - 1 for p in g._currently_processing if sum(len(s) for s in p[0]) > 1]
        return [n for n in sizes if n > 0]

    def streaming(self) -> int:
        """Streams the next step decodes for (past their prefill)."""
        return len(self.gen._generation_batch) + sum(
            1 for p in self.gen._currently_processing if sum(len(s) for s in p[0]) <= 1)

    def held_kv(self) -> int:
        """Bytes the batch's caches allocate now (every stage of mlx-lm's generator: rows
        waiting with a cached prefix, the prompt batch, the decode batch)."""
        return int(self.gen.prompt_cache_nbytes)

    def holds_finished(self) -> bool:
        """KV of finished requests waits for a plan to store or drop it."""
        return self.store is not None and bool(self.store.finished)

    # -- plan application ------------------------------------------------------------

    def apply(self, removes: list[PlanRemove], inserts: list[PlanInsert],
              cache_ops: list[CacheOp] = (), prefill_step: int = 0,
              drafts: dict[str, list[int]] | None = None) -> list[Finished]:
        """Removes first, then cache ops, then inserts, exactly as the plan lists them;
        `prefill_step` (0: unchanged, an older rank 0) is the prompt chunk from now on;
        `drafts` (request id -> tokens) are what the next step verifies."""
        if prefill_step > 0:  # every rank alike: a collective's shapes depend on it
            self.gen.prefill_step_size = prefill_step
        try:
            removed = self._apply(removes, inserts, cache_ops)
        except CacheDivergence as exc:
            raise Divergence(f"prompt cache: {exc}") from exc
        decoding = set(self.gen._generation_batch.uids)
        for rid in drafts or {}:
            a = self.by_rid.get(rid)
            if a is None or a.uid not in decoding:
                raise Divergence(f"plan drafts for {rid!r}, which is not decoding here")
        self.drafts = dict(drafts or {})
        return removed

    def _apply(self, removes, inserts, cache_ops) -> list[Finished]:
        removed: list[Finished] = []
        if removes:
            uids = []
            for r in removes:
                a = self.by_rid.get(r.request_id)
                if a is None:
                    raise Divergence(f"plan removes {r.request_id!r}, which is not in this batch")
                uids.append(a.uid)
                removed.append(Finished(a, r.reason, self.step))
            self.gen.remove(uids)
            for f in removed:
                del self.by_rid[f.active.request_id]
                del self.by_uid[f.active.uid]
        if self.store is not None:
            for op in cache_ops:  # followers take a live STORE's KV now; rank 0 took it
                if op.live and op.request_id not in self.store.finished:  # after the step
                    self.take_live(op.request_id)
            self.store.apply(list(cache_ops))
        elif cache_ops:
            raise Divergence("plan carries cache ops; the prompt cache is off on this rank")
        if inserts:
            for ins in inserts:
                if ins.request_id in self.by_rid:
                    raise Divergence(f"plan inserts {ins.request_id!r}, already in this batch")
            prompts, caches, done = self._starts(inserts)
            uids = self.gen.insert(
                prompts, caches=caches, all_tokens=done,
                max_tokens=[i.max_tokens for i in inserts],
                samplers=[sampler_for(i) for i in inserts],
                logits_processors=[logits_processors_for(i, self) for i in inserts],
                stop_sequences=[self._stops(i.stop_token_ids) for i in inserts],
            )
            expected = list(range(self.next_uid, self.next_uid + len(inserts)))
            if list(uids) != expected:
                raise Divergence(f"insert returned uids {uids}, plan order predicts {expected}")
            self.next_uid += len(inserts)
            for ins, uid in zip(inserts, uids, strict=True):
                a = Active(ins.request_id, uid, len(ins.prompt), ins.max_tokens)
                self.by_rid[a.request_id] = a
                self.by_uid[uid] = a
        return removed

    def take_live(self, request_id: str) -> tuple[list, list[int]]:
        """The KV of a request still in the batch (prompt and tokens fed so far), held
        for the plan that stores it, as a finished request's is."""
        a = self.by_rid.get(request_id)
        if a is None:
            raise Divergence(f"plan stores {request_id!r} live, which is not in this batch")
        cache, tokens = self.gen.extract_cache([a.uid])[a.uid]
        self.store.finished[request_id] = (cache, list(tokens))
        return self.store.finished[request_id]

    def _starts(self, inserts: list[PlanInsert]):
        """Each insert's prompt still to compute, the cache it starts from (None: empty)
        and the tokens that cache covers."""
        prompts, caches, done = [], [], []
        for i in inserts:
            prompt = list(i.prompt)
            if not i.cache_entry:
                prompts.append(prompt)
                caches.append(None)
                done.append([])
                continue
            if self.store is None:
                raise Divergence(f"insert {i.request_id!r} starts from the prompt cache, "
                                 "which is off on this rank")
            caches.append(self.store.start_from(i.cache_entry, i.cached_tokens, prompt))
            prompts.append(prompt[i.cached_tokens:])
            done.append(prompt[:i.cached_tokens])
        return prompts, caches, done

    def _stops(self, extra: list[int]) -> StopSequences:
        if not extra:
            return self._default_stops
        return StopSequences([(t,) for t in sorted(set(self.eos_ids) | set(extra))])

    # -- stepping ----------------------------------------------------------------------

    def next(self) -> tuple[list[Emitted], list[Finished]]:
        """One `BatchGenerator.next()`: what each request emitted (in order: a request
        whose drafts, from the last plan, were accepted emits several tokens), and who
        finished."""
        step = self.step
        before = self.gen._counters.prompt_tokens
        drafts, self.drafts = self.drafts, {}
        if drafts:
            by_uid = {self.by_rid[rid].uid: d for rid, d in drafts.items()}
            _, responses = next_with_drafts(self.gen, by_uid)
        else:
            _, responses = self.gen.next()
        self.last_prompt_tokens = self.gen._counters.prompt_tokens - before
        self.step += 1
        emitted: list[Emitted] = []
        finished: list[Finished] = []
        for r in responses:
            a = self.by_uid.get(r.uid)
            if a is None:
                raise Divergence(f"step {step} produced a token for unknown uid {r.uid}")
            token = int(r.token)
            # mlx-lm's "stop" | "length" | None, typed here (another value: a ValueError)
            end = None if r.finish_reason is None else FinishReason(r.finish_reason)
            keep = None if end == FinishReason.STOP else token
            if keep is not None:
                a.tokens.append(keep)
            emitted.append(Emitted(a, keep, end, r.logprobs))
            if end is not None:
                del self.by_rid[a.request_id]
                del self.by_uid[a.uid]
                finished.append(Finished(a, end, step, keep))
                if self.store is not None and r.prompt_cache is not None:
                    self.store.finished[a.request_id] = (r.prompt_cache, list(r.all_tokens))
        return emitted, finished

    def next_tokens(self) -> dict[str, int]:
        """Each decoding request's token drawn by the last step and not yet fed (mlx-lm
        runs one step ahead): where rank 0's drafts continue from. Waits for that step."""
        b = self.gen._generation_batch
        if not b.uids or b._next_tokens is None:
            return {}
        mx.eval(b._next_tokens)
        return {self.by_uid[u].request_id: t
                for u, t in zip(b.uids, b._next_tokens.tolist(), strict=True)}

    def drain(self) -> None:
        """Wait for work queued on the generation stream (an async step in flight)."""
        mx.synchronize(self.gen.stream)
