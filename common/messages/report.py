"""Report channel (launch key "report"), ranks → supervisor: RANK_READY once loaded,
TELEMETRY periodically (with the prompt-cache store, load progress and the phase
clock's times), CANCEL_ACK and CACHE_CLEARED answering the control channel. The
supervisor sends back only the session handshake (auth.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.base import TEXT
from common.messages.vocab import Determinism, Phase, Speculation


@dataclass
class LoadProgress:
    """A loading rank's progress (services/rank/load_progress.py): bytes this process
    has read since loading began (capped at the total) of its model's *.safetensors."""

    read_bytes: int = 0
    total_bytes: int = 0


@dataclass
class CacheStats:
    """One rank's prompt-cache store, in telemetry. The counters are cumulative; hits,
    misses and hit tokens are rank 0's decisions (zero on followers)."""

    entries: int = 0
    tokens: int = 0
    bytes: int = 0
    stored: int = 0
    evicted: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    # The disk tier (services/rank/disk_tier.py); disk hits are rank 0's decisions.
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_hits: int = 0
    disk_hit_tokens: int = 0
    disk_written: int = 0
    disk_write_errors: int = 0
    disk_rejected: int = 0
    disk_loaded: int = 0


@dataclass
class PhaseTimes:
    """Where one rank's threads spent their time since it started, in telemetry
    (services/rank/phase_clock.py): wall seconds and runs per phase of its loop, by the
    phase's name, for the phases that ran."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class KvStats:
    """One rank's KV for running requests, in telemetry (services/rank/kv_budget.py):
    `held` is what its batch's caches allocate (their nbytes) after its last step and
    `held_peak` the most after any step -- the rank's own measure, not rank 0's count;
    `reserved` (what the batch's next step may hold), `waiting`, `waits`, `refused` and
    `preemptions` are rank 0's decisions (0 on followers)."""

    budget: int = 0  # bytes per rank; 0: no budget
    slot_bytes: int = 0  # bytes per token slot on this rank (0: not measured)
    held: int = 0
    held_peak: int = 0
    reserved: int = 0  # rank 0: bytes the batch's next step may hold (its projection)
    waiting: int = 0  # rank 0: requests first in the queue that did not fit, now
    waits: int = 0  # rank 0: plans whose queue head waited for the budget (cumulative)
    refused: int = 0  # rank 0: requests refused as too large for the budget alone
    preemptions: int = 0  # rank 0: requests preempted for the budget (cumulative)
    # rank 0: requests waiting in its queue now, by priority (its decimal text) and by
    # tenant (the API key's name; "" for an open gateway)
    queued_by_priority: dict[str, int] = field(default_factory=dict)
    queued_by_tenant: dict[str, int] = field(default_factory=dict)


@dataclass
class SpecStats:
    """Rank 0's speculation (services/rank/spec_propose.py), cumulative: steps that
    verified drafts, rows they verified, drafts proposed, drafts accepted (tokens emitted
    past one per row): 1 + accepted / verify_rows is the tokens a row emits per verify."""

    verify_steps: int = 0
    verify_rows: int = 0  # rows those steps verified drafts for
    proposed: int = 0
    accepted: int = 0


@dataclass
class RankReady:
    deployment_id: str
    job_id: str
    rank: int
    host: str
    pid: int
    start_time: float
    boot_id: str
    endpoints: dict[str, str] = field(default_factory=dict)
    # its forward pass: batch-invariant or not (services/rank/determinism.py)
    determinism: Determinism = Determinism.OFF
    # rank 0: how it proposes drafts for its decode rows (services/rank/spec_propose.py)
    speculation: Speculation = Speculation.OFF


@dataclass
class Telemetry:
    deployment_id: str
    job_id: str
    rank: int
    pid: int
    phase: Phase
    step: int
    active: int
    cancel_epoch: int
    mem_active: int = 0
    mem_peak: int = 0
    at: float = 0.0
    error: str | None = field(default=None, metadata=TEXT)
    rejects: dict[str, int] = field(default_factory=dict)  # "socket.reason" -> count
    cache: CacheStats | None = None  # the prompt-cache store (None: caching off)
    load: LoadProgress | None = None  # while loading: bytes read of the weights' total
    phases: PhaseTimes | None = None  # cumulative time per loop phase (None: an older rank)
    kv: KvStats | None = None  # KV held for running requests, the budget (None: older rank)
    spec: SpecStats | None = None  # rank 0 speculating: its counts (None: not speculating)


@dataclass
class CancelAck:
    deployment_id: str
    epoch: int
    rank: int
    step_applied: int
    cancelled: list[str] = field(default_factory=list)


@dataclass
class CacheCleared:
    """Rank 0: the plan carrying clear `clear_id`'s CLEAR was published for step `step`."""

    deployment_id: str
    clear_id: int
    rank: int
    step: int
