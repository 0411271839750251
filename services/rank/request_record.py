"""Rank 0's record of one request, with a closed status the leader changes only through
its methods (vLLM's engine keeps one `RequestStatus` per request the same way):

    WAITING ──planned──> PREFILLING ──first token──> DECODING
       │                     │   └──────────┐            │  └──preempted──> PREEMPTED ──requeued──> WAITING
       │                     └──────────────┼────────────┼──preempted──────────┘
       │                     │              │            │
       │                     └──removing──> REMOVING <───┘
       │                                     │
       └──────────finished──────────────> FINISHED <──── (any running status)

- WAITING: in rank 0's queue (`Leader.pending`), in no plan yet. Aborted or cancelled
  there, it finishes at once: no rank ever held it.
- PREFILLING: inserted by a plan; its prompt is being computed, no token yet.
- DECODING: its first token was emitted.
- REMOVING: an abort or cancel decided; the next plan removes it on every rank (the
  first reason stays).
- PREEMPTED: the KV budget needs its room (services/rank/kv_budget.py): the plan frees
  its KV on every rank and it is re-queued at once as prompt + produced tokens (first
  in line), its stream left open; prefilled again, it goes on where it stopped.
- FINISHED: its last chunk was sent; the record leaves the leader.

Any other change raises `IllegalTransition`: a bug, never a request's fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.messages import FinishReason, PlanInsert, RemoveReason
from services.rank.wait_queue import Waiting


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    REMOVING = "removing"
    PREEMPTED = "preempted"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


RUNNING = frozenset({Status.PREFILLING, Status.DECODING, Status.REMOVING})  # in the batch
PREEMPTIBLE = frozenset({Status.PREFILLING, Status.DECODING})
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.PREFILLING, Status.FINISHED}),
    Status.PREFILLING: frozenset({Status.DECODING, Status.REMOVING, Status.PREEMPTED,
                                  Status.FINISHED}),
    Status.DECODING: frozenset({Status.REMOVING, Status.PREEMPTED, Status.FINISHED}),
    Status.REMOVING: frozenset({Status.FINISHED}),
    Status.PREEMPTED: frozenset({Status.WAITING, Status.FINISHED}),
    Status.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A status change the table does not allow."""


@dataclass
class RequestRecord:
    insert: PlanInsert
    received_at: float  # monotonic, at the I/O thread (model_ttft_ms counts from it)
    first_at: float | None = None
    cached_tokens: int = 0  # of the prompt, served from the prefix cache
    status: Status = Status.WAITING
    remove_reason: RemoveReason | None = None  # REMOVING: why (the first reason given)
    finish_reason: FinishReason | None = None  # FINISHED: how
    preemptions: int = 0  # times it was preempted (the KV budget, a higher priority)
    # its place in rank 0's queue: priority, arrival, tenant and weight (wait_queue.py)
    waiting: Waiting = field(default_factory=lambda: Waiting(0, 0))
    said_at: float = 0.0  # monotonic: the last "still waiting" heartbeat sent for it

    @property
    def request_id(self) -> str:
        return self.insert.request_id

    def _to(self, new: Status) -> None:
        if new not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"{self.request_id}: {self.status} -> {new}")
        self.status = new

    def planned(self) -> None:
        """A plan inserts it: every rank starts its prompt."""
        self._to(Status.PREFILLING)

    def first_token(self, at: float) -> float | None:
        """Its first token (since it was planned) is emitted at `at` (monotonic); returns
        the TTFT in ms, or None after a preemption (the client had its first token)."""
        self._to(Status.DECODING)
        if self.first_at is not None:
            return None
        self.first_at = at
        return (at - self.received_at) * 1000.0

    def removing(self, reason: RemoveReason) -> bool:
        """An abort or cancel for a request in the batch: the next plan removes it.
        False if it is already being removed (its first reason stays)."""
        if self.status is Status.REMOVING:
            return False
        self._to(Status.REMOVING)
        self.remove_reason = reason
        return True

    def preempted(self) -> None:
        self._to(Status.PREEMPTED)
        self.preemptions += 1

    def requeued(self, continuation: PlanInsert | None = None) -> None:
        """Back in the queue; `continuation`: what it is inserted as from now on."""
        self._to(Status.WAITING)
        if continuation is not None:
            self.insert = continuation

    def finished(self, reason: FinishReason) -> None:
        self._to(Status.FINISHED)
        self.finish_reason = reason
