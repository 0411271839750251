"""Control channel (launch key "control"), supervisor PUB → every rank: CANCEL, SERVE,
SHUTDOWN, LEASE (the supervisor is alive: a rank whose lease goes stale stops) and
CACHE_CLEAR. The ranks answer on the report channel (report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.vocab import CancelScope


@dataclass
class Cancel:
    deployment_id: str
    epoch: int
    scope: CancelScope
    request_ids: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass
class Serve:
    deployment_id: str
    job_id: str


@dataclass
class Shutdown:
    deployment_id: str
    job_id: str
    reason: str = ""


@dataclass
class CacheClear:
    """Admin `cache_clear`: rank 0 folds a CLEAR op into its next plan (every rank empties
    its prefix cache at that step) and answers CACHE_CLEARED. Re-sent until answered;
    rank 0 applies each `clear_id` once and answers every copy."""

    deployment_id: str
    clear_id: int


@dataclass
class Lease:
    deployment_id: str
    job_id: str
    lease_seq: int
    ttl_s: float
    cancel_epoch: int
