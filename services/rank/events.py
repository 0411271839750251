"""What the I/O thread hands the main thread (through `RankIO.inbox`); the other way is
services/rank/outbox.py."""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import (
    Abort,
    CacheClear,
    Cancel,
    DiskIndex,
    Generate,
    Lease,
    Phase,
    Plan,
    RemoveReason,
    Serve,
    Shutdown,
)


@dataclass
class LeaseSeen:  # the first LEASE on control (slow-joiner proof)
    lease: Lease


@dataclass
class Joined:  # follower: rank 0 welcomed us; leader: every follower said hello
    next_seq: int


@dataclass
class ServeEv:
    body: Serve


@dataclass
class ShutdownEv:
    body: Shutdown


@dataclass
class SignalEv:
    signum: int


@dataclass
class CancelEv:
    body: Cancel


@dataclass
class CacheClearEv:  # rank 0: an admin cache clear, the first copy (services.rank.cache_clears)
    body: CacheClear


@dataclass
class GenerateEv:  # rank 0: its stream is already open in the I/O thread's ledger
    body: Generate
    received_at: float  # time.monotonic() at the I/O thread (a wall clock may jump)


@dataclass
class AbortEv:
    body: Abort
    # the requester's connection is gone (rank 0's I/O thread could not deliver its
    # tokens: EHOSTUNREACH on the ROUTER), not an ABORT it sent
    requester_gone: bool = False


@dataclass
class AbortAllEv:  # from a watchdog through RankRuntime.request_abort_all
    reason: RemoveReason  # the removal reason (plans, removal records)


@dataclass
class ExitEv:  # a watchdog asks the main thread to leave cleanly (services.rank.watchdog_thread)
    code: int
    phase: Phase
    reason: str


@dataclass
class DiskIndexEv:  # leader: a follower's disk tier report (services/rank/disk_report.py)
    body: DiskIndex


@dataclass
class PlanEv:  # follower: the next plan, in sequence order
    plan: Plan


@dataclass
class PlanMissingEv:  # follower: a plan the leader can no longer replay
    from_seq: int
    detail: str


@dataclass
class IoFailed:
    error: str
