"""Plan channel (launch key "plan"), rank 0 ↔ followers: rank 0 publishes one PLAN per
step (what every rank applies before it: removes, cache ops, inserts), followers say
PLAN_HELLO (→ PLAN_WELCOME) on joining, PLAN_FETCH (→ PLAN_BATCH) to replay plans they
missed, and answer rank 0's PING with PONG. The socket's session handshake is auth.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.messages.base import BIG_LIST
from common.messages.sampling import SeededSampling
from common.messages.vocab import Phase, RemoveReason


@dataclass
class PlanInsert:
    request_id: str
    prompt: list[int] = field(metadata=BIG_LIST)
    max_tokens: int
    # The GENERATE's sampling as rank 0 checked it, its seed fixed: every rank applies it
    # alike (common/messages/sampling.py).
    sampling: SeededSampling
    stop_token_ids: list[int] = field(default_factory=list)
    # Prefix cache (services/rank/prefix_cache.py): start from entry `cache_entry` (0:
    # none) trimmed to its first `cached_tokens` tokens, which equal the prompt's.
    cache_entry: int = 0
    cached_tokens: int = 0
    top_logprobs: int = -1  # as in Generate; rank 0 alone reads it (followers send no tokens)
    resumed: int = 0  # as in Generate: the prompt's last `resumed` tokens are output so far


@dataclass
class PlanRemove:
    request_id: str
    reason: RemoveReason


class CacheOpKind(str, enum.Enum):
    """What a plan does to every rank's prompt-cache store (applied in plan order)."""

    STORE = "store"  # keep the KV of `request_id`, which finished at the previous step
    EVICT = "evict"  # drop entry `entry_id` (from memory; its disk copy stays)
    CLEAR = "clear"  # drop every entry, from memory and disk
    LOAD = "load"  # read disk entry `key` into memory as entry `entry_id`
    DROP = "drop"  # delete disk entry `key`


@dataclass
class CacheOp:
    kind: CacheOpKind
    entry_id: int = 0
    request_id: str = ""
    n_tokens: int = 0  # STORE: the tokens the entry covers (prompt + generated, as fed)
    nbytes: int = 0  # STORE: rank 0's bytes for it, the budget's unit; a rank holding more fails
    live: bool = False  # STORE of a request still in the batch (its prompt, once prefilled)
    # The disk tier (services/rank/disk_tier.py): the entry's content key (a hash of its
    # tokens, the same on every rank and across launches), and for a STORE whether every
    # rank writes it through to its disk.
    key: str = ""
    persist: bool = False


@dataclass
class Plan:
    """Everything every rank applies before step `step` (advance=False: apply only):
    removes, then cache ops, then inserts."""

    seq: int
    step: int
    advance: bool
    inserts: list[PlanInsert] = field(default_factory=list)
    removes: list[PlanRemove] = field(default_factory=list)
    cancel_epoch: int = 0  # epoch folded into this plan, 0 if none
    shutdown: bool = False
    cache: list[CacheOp] = field(default_factory=list)
    prefill_step: int = 0  # prompt tokens per chunk from this step on (0: the settings')
    # Speculation (services/rank/spec_step.py): request id -> the drafts its decode row
    # verifies in this step, proposed by rank 0; every rank verifies the same ones.
    drafts: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PlanHello:
    rank: int


@dataclass
class PlanWelcome:
    rank: int
    next_seq: int


@dataclass
class PlanFetch:
    from_seq: int


@dataclass
class PlanBatch:
    plans: list[Plan]
    missing: bool = False  # the replay buffer no longer holds from_seq


@dataclass
class Ping:
    nonce: int
    sent_at: float
    # The last DISK_INDEX seq rank 0 took from each rank (index = rank): a follower
    # re-sends its report until it sees its seq here.
    disk_seqs: list[int] = field(default_factory=list)


@dataclass
class DiskIndex:
    """A follower's disk tier, for rank 0 (services/rank/disk_tier.py): the entries it
    verified at start-up (`boot`: None once reported), and the keys whose write-through
    failed since (rank 0 drops them on every rank). Re-sent until a PING acknowledges
    `seq`; `off`: this rank's disk tier is off (rank 0 then persists nothing)."""

    rank: int
    seq: int
    verified: list[str] = field(default_factory=list, metadata=BIG_LIST)
    failed: list[str] = field(default_factory=list, metadata=BIG_LIST)
    off: bool = False


@dataclass
class Pong:
    nonce: int
    rank: int
    step: int
    phase: Phase
