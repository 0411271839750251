"""Rank 0's loop: requests in, one plan per step out, tokens streamed back.

    drain inbox (block only when nothing is active or pending)
    → build the plan: removes (aborts, a cancel epoch) first, then inserts
    → apply it locally (a plan rank 0 cannot apply is never published)
    → hand it to the I/O thread (fan-out to every follower + replay buffer)
    → next() iff anything is in the batch → stream each request's token

`scheduled` is what this thread plans for (pending, or in the batch); whether a stream
is open, on which connection and at which index is the I/O thread's stream ledger's
(services/rank/streams.py): this thread sends chunks by request id (`StreamChunk`).

A cancel-only plan with an empty batch has advance=False. At most one cancel epoch is
folded into a plan, lowest first, so every epoch has one plan and one step.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from common import request_params
from common.messages import (
    CancelScope,
    ErrorCode,
    FinishReason,
    Generate,
    Phase,
    Plan,
    PlanInsert,
    PlanRemove,
    RemoveReason,
    Speculation,
)
from services.rank import events as ev
from services.rank.cache_clears import answers as clear_answers
from services.rank.disk_plan import DiskPlanner
from services.rank.engine import Divergence, Emitted
from services.rank.kv_budget import MIN_PROGRESS, UNBOUNDED, KvBudget, Row
from services.rank.logprobs import chunk_fields, step_logprobs
from services.rank.loop import RankLoop
from services.rank.outbox import CacheOpsTaken, Command, PublishPlan, StreamChunk
from services.rank.phase_clock import LoopPhase
from services.rank.planwire import MAX_BATCH_BYTES, plan_size
from services.rank.prefill_policy import PrefillGate, StallBudget, share
from services.rank.prefix_cache import WAIT, CachePlanner
from services.rank.prefix_store import cache_bytes
from services.rank.request_record import PREEMPTIBLE, RequestRecord, Status
from services.rank.sampling import sampling_problem, top_logprobs_problem
from services.rank.spec_propose import DRAFTS, Proposer, ReplayDrafts
from services.rank.wait_queue import Waiting, WaitQueue

log = logging.getLogger("lockstep.rank.leader")
LOOKAHEAD = 16  # waiting prompts a plan looks past the head for (grouping by length)
MAX_TENANT = 256  # an API key's name, as the gateway sends it
MAX_WEIGHT = 1000  # a tenant's weight (services/gateway/core/auth.py's bound)
WAITING_HEARTBEAT_S = 1.0  # "still waiting" to the gateway, per request without output
SILENT = frozenset({Status.WAITING, Status.PREFILLING, Status.PREEMPTED})  # no tokens now


def disk_planner(store, settings, world_size: int) -> DiskPlanner | None:
    """Rank 0's disk-tier planner, from its own start-up scan; None if the tier is off
    here (then followers' files are left alone, and nothing is written)."""
    if store.disk is None:
        return None
    boot = {k: (e.tokens, e.nbytes, e.used_at) for k, e in store.disk_boot.items()}
    return DiskPlanner(settings.prompt_cache_disk_bytes, world_size - 1, boot)


class Leader(RankLoop):
    def __init__(self, *args, vocab_size: int, context: int | None = None,
                 kv: KvBudget | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.vocab_size = vocab_size
        self.context = context  # prompt + completion must fit (None: unknown)
        self.kv = kv  # the KV budget admission reserves against (None: no budget)
        # rank 0's drafts for the decode rows to verify (None: no speculation)
        self.proposer = None
        if self.settings.speculative is Speculation.NGRAM:
            p = self.rt.seams.drafts_p  # the test proposer (tests only)
            self.proposer = Proposer(replay=None if p is None else ReplayDrafts(p, vocab_size))
        # Every request not finished, with its status (request_record.py): the one
        # account of where a request is. `pending` orders the WAITING ones.
        self.scheduled: dict[str, RequestRecord] = {}
        self.pending = WaitQueue()
        self.arrivals = 0  # GENERATEs taken: a request's place among its priority
        self.cancels: dict[int, object] = {}  # epoch → Cancel, not yet folded
        self.seq = 0
        self.out: list[Command] = []  # for the I/O thread, handed over once per iteration
        store = self.engine.store  # None: the prefix cache is off
        self.cache = None if store is None else \
            CachePlanner(store.max_entries, store.max_bytes, self.engine.trimmable,
                         disk_planner(store, self.settings, self.rt.spec.world_size))
        if self.cache is not None and self.cache.disk is not None:
            self.cache.disk_load = store.preload  # rank 0 reads its own copy first
            self.rt.disk_acks = self.cache.disk.acks(self.rt.spec.world_size)
        s = self.settings
        self.stall = StallBudget(s.prefill_stall_ratio, s.prefill_step)
        self.steered = False  # the last plan's step was steered (prefill_policy.py)
        self.share = 1.0  # the last plan's waiting/streams factor (prefill_policy.share)
        self._heartbeat_at = 0.0  # monotonic: the next scan for silent requests
        self.rt.on_exit(self._end_all_streams)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        for e in self.stash:
            self.handle(e)
        self.stash.clear()
        while True:
            if not self.busy():
                self.flush()
                self.drain(block=True)
            else:
                self.drain(block=False)
            if self.busy():
                self.plan_and_step()

    def busy(self) -> bool:
        """Something for the next plan: the batch, requests, removes, a cancel, or cache
        decisions (finished KV is stored or dropped by a plan, not left waiting)."""
        return bool(self.engine.has_work() or self.pending or self.removing() or self.cancels
                    or self.engine.holds_finished()
                    or (self.cache is not None and self.cache.has_ops()))

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {**super().handlers(),
                ev.GenerateEv: self.on_generate,
                # from the requester, or its disappearance (io)
                ev.AbortEv: lambda e: self.on_abort(
                    e.body.request_id,
                    RemoveReason.REQUESTER_GONE if e.requester_gone else RemoveReason.ABORT),
                ev.AbortAllEv: self.on_abort_all,
                ev.CacheClearEv: self.on_cache_clear,
                ev.DiskIndexEv: self.on_disk_index}

    def handle(self, e: object) -> None:
        t0 = self.clock.now()  # LoopPhase.DRAIN: the handling, never the wait for it
        super().handle(e)
        self.clock.add(LoopPhase.DRAIN, t0)

    def on_abort_all(self, e: ev.AbortAllEv) -> None:
        for rid in list(self.scheduled):
            self.on_abort(rid, e.reason)

    def on_cache_clear(self, e: ev.CacheClearEv) -> None:
        if self.cache is not None:  # off: io answered
            self.cache.request_clear(e.body.clear_id)

    def on_disk_index(self, e: ev.DiskIndexEv) -> None:
        if self.cache is not None and self.cache.disk is not None:
            self.cache.disk.report(e.body)
            self.rt.disk_acks = self.cache.disk.acks(self.rt.spec.world_size)
        else:  # no disk tier here: acknowledged all the same (nothing to plan)
            acks = self.rt.disk_acks or [0] * self.rt.spec.world_size
            acks[e.body.rank] = max(acks[e.body.rank], e.body.seq)
            self.rt.disk_acks = list(acks)

    def on_generate(self, e: ev.GenerateEv) -> None:
        g = e.body
        # A duplicate of an open stream never gets here: the ledger answered it.
        problem = self.validate(g)
        if problem is None and self.rt.phase != Phase.SERVING:
            problem = ErrorCode.NOT_SERVING, f"not serving (phase {self.rt.phase.value})"
        if problem is not None:
            code, text = problem
            self.send(StreamChunk(g.request_id, finish_reason=FinishReason.ERROR, error=text,
                                  error_code=code))
            return
        max_tokens = g.max_tokens  # the gateway's decision (its default, the client's)
        if self.context is not None:  # clamp to what fits in the model's context
            max_tokens = min(max_tokens, self.context - len(g.prompt))
        if self.kv is not None:  # ... and to what fits in the KV budget alone
            alone = self.kv.max_tokens_alone(len(g.prompt))
            if alone < 1:
                self.rt.kv = replace(self.rt.kv, refused=self.rt.kv.refused + 1)
                self.send(StreamChunk(g.request_id, finish_reason=FinishReason.ERROR,
                                      error=self.kv.refusal(len(g.prompt)),
                                      error_code=ErrorCode.KV_BUDGET))
                return
            max_tokens = min(max_tokens, alone)
        ins = PlanInsert(
            request_id=g.request_id, prompt=g.prompt, max_tokens=max_tokens,
            sampling=g.sampling.seeded(g.sampling.seed),
            stop_token_ids=sorted(set(g.stop_token_ids)), top_logprobs=g.top_logprobs,
            resumed=g.resumed)
        self.arrivals += 1
        self.scheduled[g.request_id] = RequestRecord(
            ins, e.received_at, waiting=Waiting(g.priority, self.arrivals, g.tenant,
                                                g.tenant_weight, since=e.received_at))
        self.queue(g.request_id)
        self.publish_counts()

    def validate(self, g: Generate) -> tuple[ErrorCode, str] | None:
        """Why rank 0 refuses `g` (a typed code, and text for people), or None."""
        bad = ErrorCode.INVALID_REQUEST
        if not g.request_id:
            return bad, "empty request_id"
        if not g.prompt:
            return bad, "empty prompt"
        v = self.vocab_size
        if any(t < 0 or t >= v for t in g.prompt) or any(t < 0 or t >= v for t in g.stop_token_ids):
            return bad, f"token id out of range [0, {v})"
        why = sampling_problem(g.sampling, v) or top_logprobs_problem(g.top_logprobs)
        if why is not None:
            return bad, why
        if g.max_tokens < 1:
            return bad, "max_tokens must be >= 1 (its sender decides it)"
        if (why := request_params.problem("priority", g.priority)) is not None:
            return bad, why
        if len(g.tenant) > MAX_TENANT or not 1 <= g.tenant_weight <= MAX_WEIGHT:
            return bad, (f"tenant must be at most {MAX_TENANT} characters, tenant_weight "
                         f"in [1, {MAX_WEIGHT}]")
        if not 0 <= g.resumed < len(g.prompt):  # at least one token of the original prompt
            return bad, f"resumed must be in [0, {len(g.prompt)})"
        if self.context is not None and len(g.prompt) >= self.context:
            return ErrorCode.PROMPT_TOO_LONG, \
                f"prompt of {len(g.prompt)} tokens does not fit the context ({self.context})"
        if plan_size(Plan(0, 0, True, [PlanInsert(g.request_id, g.prompt, 1, g.sampling.seeded(0),
                                                  g.stop_token_ids)])) > MAX_BATCH_BYTES:
            return ErrorCode.PROMPT_TOO_LONG, "prompt too long"
        if g.sampling.grammar:  # compiled here first: every rank compiles the same text alike
            why = "this rank has no tokenizer" if self.engine.grammars is None \
                else self.engine.grammars.check(g.sampling.grammar)
            if why is not None:
                return bad, f"grammar: {why}"
        return None

    def on_abort(self, rid: str, reason: RemoveReason) -> None:
        rec = self.scheduled.get(rid)
        if rec is None:
            return  # finished already, or never ours
        if rec.status is Status.WAITING:  # it never reached a plan: no rank holds it
            self.pending.remove(rid)
            self.finish(rid, FinishReason.ABORT, error=None)
            self.publish_counts()
        else:
            rec.removing(reason)  # the next plan removes it on every rank

    def removing(self) -> dict[str, RemoveReason]:
        """The requests the next plan removes, and why."""
        return {rid: rec.remove_reason for rid, rec in self.scheduled.items()
                if rec.status is Status.REMOVING and rec.remove_reason is not None}

    def on_cancel(self, c) -> None:
        if c.epoch > self.rt.cancel_epoch and c.epoch not in self.cancels:
            self.cancels[c.epoch] = c

    # -- plans and steps -----------------------------------------------------------------

    def plan_and_step(self) -> None:
        t0 = self.clock.now()  # LoopPhase.PLAN: build, apply, publish, book-keep
        removes = {rid: why for rid, why in self.removing().items() if self.engine.has(rid)}
        epoch = 0
        if self.cancels:
            epoch = min(self.cancels)
            c = self.cancels.pop(epoch)
            targets = list(self.scheduled) if c.scope == CancelScope.ALL else list(c.request_ids)
            for rid in targets:
                rec = self.scheduled.get(rid)
                if rec is None:
                    continue
                if rec.status is Status.WAITING:
                    self.pending.remove(rid)
                    self.finish(rid, FinishReason.ABORT, error=None)
                elif self.engine.has(rid):
                    rec.removing(RemoveReason.CANCEL)
                    removes.setdefault(rid, rec.remove_reason or RemoveReason.CANCEL)
        # Cache ops before inserts: each insert matches the index as every rank holds
        # it once this plan's stores and evictions are applied.
        if self.cache is not None and self.cache.disk is not None:
            for key in self.engine.store.disk.take_failed():  # our own writes that failed
                self.cache.disk.lost(key)
        ops = self.cache.take_ops() if self.cache is not None else []
        inserts: list[PlanInsert] = []
        budget = MAX_BATCH_BYTES
        waiting: list[str] = []  # kept pending, in order: for a running prefill, or later
        gate = self.prefill_gate()
        # The KV budget (kv_budget.py): the batch's rows after this plan's removes, less
        # the ones preempted so that the rest can take their next step.
        rows = self.batch_rows(removes)
        for rid in (self.kv.victims(rows) if self.kv is not None else []):
            self.preempt(rid, removes, rows)
        kv_waits = False
        while self.pending and len(waiting) < LOOKAHEAD and gate.more():
            rid = self.pending.head()
            req = self.scheduled[rid]
            ins = req.insert
            left = self.remaining(ins.prompt)
            if not gate.admits(left):
                waiting.append(self.pending.pop())  # a later one may group here
                continue
            room = self.kv or UNBOUNDED
            if len(rows) + 1 > self.settings.max_batch or not room.fits(
                    [*(r.length for r in rows.values()), len(ins.prompt)]):
                # no slot or no KV: lower-priority rows make room, or it waits first in
                # line (nothing overtakes it)
                victims = room.room_for(rows, len(ins.prompt), req.waiting.priority,
                                        self.settings.max_batch)
                if victims is None:
                    kv_waits = self.kv is not None
                    break
                for v in victims:
                    self.preempt(v, removes, rows)
            budget -= plan_size(Plan(0, 0, True, [ins]))
            if inserts and budget < 0:
                break
            self.pending.pop()
            if self.cache is not None:
                entry, n = self.cache.plan_insert(rid, ins.prompt)
                if entry == WAIT:
                    gate.withdraw(left)
                    waiting.append(rid)
                    continue
                if entry:
                    ins = replace(ins, cache_entry=entry, cached_tokens=n)
                    req.cached_tokens = n
            req.planned()
            self.pending.admitted(rid, req.waiting)
            inserts.append(ins)
            rows[rid] = Row(len(ins.prompt), self.engine.next_uid + len(inserts),
                            priority=req.waiting.priority, pinned=True)
        for rid in waiting:
            self.queue(rid)
        if self.kv is not None:
            kv = self.rt.kv
            self.rt.kv = replace(kv, waiting=int(kv_waits), waits=kv.waits + kv_waits)
        if self.cache is not None:  # the LOADs the inserts start from, and their room
            ops += self.cache.take_loads()
        plan_removes = [PlanRemove(request_id=rid, reason=why) for rid, why in removes.items()]
        chunk = gate.chunk()
        self.steered = gate.steering() and not gate.boosted()  # what StallBudget learns from
        drafts = {} if self.proposer is None or not self.room_for_drafts(rows) else \
            self.proposer.drafts(self.engine, removes, self.insert_of)
        try:
            removed = self.engine.apply(plan_removes, inserts, ops, chunk, drafts)
        except Exception as exc:  # noqa: BLE001 - never publish a plan rank 0 can't apply
            self.fail(f"rank 0 cannot apply its own plan: {exc!r}")
        plan = Plan(seq=self.seq, step=self.engine.step, advance=self.engine.has_work(),
                    inserts=inserts, removes=plan_removes, cancel_epoch=epoch, cache=ops,
                    prefill_step=chunk, drafts=drafts)
        self.seq += 1
        self.send(PublishPlan(plan))
        if ops:  # what every rank holds from this plan on: the gateways' cache index
            self.send(CacheOpsTaken(ops, self.cache.taken_tokens))
        self.applied_cache(plan)
        if self.cache is not None:  # admin cache clears this plan's CLEAR answers
            self.send(*clear_answers(self.cache.take_cleared(), self.rt.spec.deployment_id,
                                     plan.step))
        requeue = []
        for f in removed:
            self.record(f)
            if f.reason == RemoveReason.PREEMPT:  # its stream stays open: it comes back
                requeue.append(self.continuation(f))
            else:
                self.finish(f.active.request_id, FinishReason.ABORT, error=None, step=f.step)
            if self.cache is not None:
                self.cache.left(f.active.request_id)
        for rid in requeue:  # back ahead of every later arrival of its priority
            self.queue(rid)
        if epoch:
            self.consume_cancel(plan)
        self.publish_counts()
        self.clock.add(LoopPhase.PLAN, t0)
        if plan.advance:
            # One hand-over per step, just before next(): the I/O thread then signs and
            # sends while this thread is inside MLX (GIL released), not in its way.
            self.flush()
            self.step()

    def insert_of(self, rid: str) -> PlanInsert | None:
        rec = self.scheduled.get(rid)
        return None if rec is None else rec.insert

    def room_for_drafts(self, rows: dict[str, Row]) -> bool:
        """Drafts widen the step: every row of the verify step is fed up to DRAFTS tokens
        more, whose KV the cache holds until the step drops the rejected ones. Under a KV
        budget that no longer fits, speculation is off for this step (it goes before any
        preemption: `victims` counts rows without drafts)."""
        return self.kv is None or self.kv.fits(r.length + DRAFTS for r in rows.values())

    def batch_rows(self, removes: dict[str, RemoveReason]) -> dict[str, Row]:
        """The batch as this plan leaves it (less its removes), as preemption sees it:
        requests being removed count as rows that cannot be preempted."""
        rows = {}
        for rid, a in self.engine.by_rid.items():
            if rid in removes:
                continue
            rec = self.scheduled.get(rid)
            movable = rec is not None and rec.status in PREEMPTIBLE
            rows[rid] = Row(a.prompt_len + len(a.tokens), a.uid,
                            protected=movable and rec.preemptions > 0
                            and len(a.tokens) < MIN_PROGRESS,
                            priority=rec.waiting.priority if rec is not None else 0,
                            pinned=not movable)
        return rows

    def preempt(self, rid: str, removes: dict[str, RemoveReason], rows: dict[str, Row]) -> None:
        """`rid` leaves the batch at this plan on every rank, to come back (continuation)."""
        self.scheduled[rid].preempted()
        removes[rid] = RemoveReason.PREEMPT
        del rows[rid]

    def queue(self, rid: str) -> None:
        self.pending.push(rid, self.scheduled[rid].waiting)

    def continuation(self, f) -> str:
        """A preempted request back in the queue as its prompt + the tokens it produced
        (the resume path's continuation: its sampling keys, penalties and grammar go on
        from there), to be prefilled again; returns its id."""
        rid, produced = f.active.request_id, list(f.active.tokens)
        rec = self.scheduled[rid]
        ins = rec.insert
        rec.requeued(replace(ins, prompt=[*ins.prompt, *produced],
                             resumed=ins.resumed + len(produced),
                             max_tokens=ins.max_tokens - len(produced),
                             cache_entry=0, cached_tokens=0))
        kv = self.rt.kv
        self.rt.kv = replace(kv, preemptions=kv.preemptions + 1)
        log.info("preempted %s after %d token(s): KV budget", rid, len(produced))
        return rid

    def prefill_gate(self) -> PrefillGate:
        """This plan's prefill decisions (services/rank/prefill_policy.py)."""
        s = self.settings
        prefilling = self.engine.prefilling()
        streams = self.engine.streaming()
        self.share = share(len(self.pending) + len(prefilling), streams)
        steered = self.stall.tokens(self.share) if self.stall.on else None
        long_running = 0 if steered is None else sum(
            1 for n in self.engine.prefill_sizes() if n > s.prefill_long_prompt)
        return PrefillGate(prefilling, streams > 0, s.prefill_batch, s.prefill_step,
                           s.prefill_step_decoding, steered, s.prefill_long_prompt,
                           long_running)

    def remaining(self, prompt: list[int]) -> int:
        """Prompt tokens to compute before the first token (the cache's best hit off)."""
        held = 0 if self.cache is None else self.cache.peek(np.asarray(prompt, np.int64))[1]
        return len(prompt) - held - 1

    def step(self) -> list[Emitted]:
        delay = self.rt.seams.step_delay_s
        if delay:
            time.sleep(delay)
        streams = self.engine.streaming()
        t0 = time.perf_counter()
        emitted = super().step()  # removals recorded before the streams end
        if self.proposer is not None:
            self.proposer.observe(emitted)
            self.rt.spec_stats = self.proposer.counts
        self.stall.observe(time.perf_counter() - t0, self.engine.last_prompt_tokens,
                           streams, self.share, self.steered)
        if self.cache is not None:
            self.plan_stores(emitted)
        self.emit(emitted)
        self.publish_counts()
        self.heartbeat(time.monotonic())
        return emitted

    def heartbeat(self, now: float) -> None:
        """A request that waits (the queue, the KV budget, a preemption) or prefills sends
        no tokens, maybe for longer than the gateway's read timeout: tell the gateway it
        is still held, once per WAITING_HEARTBEAT_S. A rank 0 that stopped stepping sends
        none, so the read timeout still ends streams on a stuck model."""
        if now < self._heartbeat_at:
            return
        self._heartbeat_at = now + WAITING_HEARTBEAT_S
        for rid, rec in self.scheduled.items():
            if rec.status in SILENT and now - max(rec.said_at, rec.received_at) \
                    >= WAITING_HEARTBEAT_S:
                rec.said_at = now
                self.send(StreamChunk(rid, step=self.engine.step, waiting=True))

    def plan_stores(self, emitted: list[Emitted]) -> None:
        """What the next plan stores: the model's finishes (prompt + reply), and the
        prompt KV of requests others wait for, once prefilled (live)."""
        finished = self.engine.store.finished
        for rid, (kv, tokens) in finished.items():
            self.cache.finished(rid, tokens, cache_bytes(kv))
            self.cache.left(rid)
        # a row's first tokens: none before this step (a verify step may emit several)
        this_step = Counter(e.active.request_id for e in emitted if e.token is not None)
        firsts = {e.active.request_id: e.active for e in emitted
                  if len(e.active.tokens) == this_step[e.active.request_id]}
        for rid in firsts:
            if rid not in finished and self.cache.first_token(rid) and self.engine.has(rid):
                kv, tokens = self.engine.take_live(rid)
                self.cache.finished(rid, tokens, cache_bytes(kv), live=True)

    def publish_cache(self) -> None:
        stats = self.engine.store.stats()
        self.rt.cache = stats if self.cache is None else self.cache.stats(stats)

    def emit(self, emitted: list[Emitted]) -> None:
        t0 = self.clock.now()  # LoopPhase.EMIT
        now = time.time()
        step = self.engine.step - 1
        # One batched extraction per step, for the requests that asked (top_logprobs >= 0).
        lps = step_logprobs(emitted, lambda rid: self.scheduled[rid].insert.top_logprobs)
        by_rid: dict[str, list[int]] = {}  # a request's emissions this step, in order
        for i, e in enumerate(emitted):
            by_rid.setdefault(e.active.request_id, []).append(i)
        for rid, idx in by_rid.items():
            req = self.scheduled[rid]
            ttft = None
            if req.status is Status.PREFILLING:  # the TTFT is a duration: never the wall clock
                ttft = req.first_token(time.monotonic())
            toks = [emitted[i].token for i in idx if emitted[i].token is not None]
            end = emitted[idx[-1]].finish_reason  # a finish is a request's last emission
            self.out.append(StreamChunk(rid, toks, end, step, ttft, [now] * len(toks),
                                        cached_tokens=req.cached_tokens if ttft is not None
                                        else 0, **chunk_fields([lps[i] for i in idx
                                                                if i in lps])))
            if end is not None:
                if self.proposer is not None and self.proposer.replay is not None:
                    self.proposer.replay.remember(req.insert, emitted[idx[-1]].active.tokens)
                req.finished(end)
                del self.scheduled[rid]
        self.clock.add(LoopPhase.EMIT, t0)

    def finish(self, rid: str, reason: FinishReason, *, error: str | None,
               step: int | None = None, code: ErrorCode | None = None) -> None:
        rec = self.scheduled.pop(rid, None)
        if rec is None:
            return
        rec.finished(reason)
        self.send(StreamChunk(rid, finish_reason=reason, error=error, error_code=code,
                              step=self.engine.step if step is None else step))

    def publish_counts(self) -> None:
        self.rt.active_ids = self.engine.active_ids()
        self.rt.pending = len(self.pending)
        reserved = 0 if self.kv is None else self.kv.need(  # what the next step may hold
            a.prompt_len + len(a.tokens) for a in self.engine.by_rid.values())
        self.rt.kv = replace(self.rt.kv, reserved=reserved, queued_by_priority={
            str(p): n for p, n in self.pending.by_priority().items()},
            queued_by_tenant=self.pending.by_tenant())

    def send(self, *cmds: Command) -> None:
        self.out.extend(cmds)

    def flush(self) -> None:
        if self.out:
            cmds, self.out = self.out, []
            self.io.post(*cmds)

    # -- leaving ---------------------------------------------------------------------------

    def _end_all_streams(self, reason: str) -> None:
        graceful = self.rt.phase in (Phase.EXITING, Phase.DRAINING)
        while True:  # requests that arrived while the last step ran: never planned
            try:
                e = self.io.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(e, ev.GenerateEv):
                self.send(StreamChunk(e.body.request_id, finish_reason=FinishReason.ERROR,
                                      error=f"rank 0 stopped: {reason}",
                                      error_code=ErrorCode.RANK_STOPPED))
        for rid in list(self.scheduled):
            if graceful:
                self.finish(rid, FinishReason.ABORT, error=None)
            else:
                self.finish(rid, FinishReason.ERROR, error=f"rank 0 stopped: {reason}",
                            code=ErrorCode.RANK_STOPPED)
        self.flush()

    def shutdown(self, reason: str, code: int = 0, phase: Phase = Phase.EXITING) -> None:
        """Graceful: every follower gets a final plan that empties the batch, so all
        ranks record the same removals and leave at the same step. A watchdog's exit
        (`code`, `phase`: launcher_lost, peer_lost) takes the same path."""
        if phase == Phase.EXITING:
            self.rt.set_phase(Phase.DRAINING)
        removes = [PlanRemove(request_id=rid, reason=RemoveReason.SHUTDOWN)
                   for rid in self.engine.active_ids()]
        try:
            removed = self.engine.apply(removes, [])
        except Divergence as exc:
            self.fail(str(exc))
        plan = Plan(seq=self.seq, step=self.engine.step, advance=False, removes=removes,
                    shutdown=True)
        self.seq += 1
        self.send(PublishPlan(plan))
        for f in removed:
            self.record(f)
        self.leave(code, phase, reason if code else None)  # the exit hook flushes
