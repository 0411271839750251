"""reap — one reap pass now (the same pass that runs at start and before every launch).

    request  {}
    reply    ReapReport {reaped: [job_id], active: [job_id], awaiting_adoption: {job_id:
              why}, failures: [{job_id, reason,
              survivors}], unreadable: [{path, error}], steps: {job_id: [step]},
              retired_markers: [deployment_id], unreadable_markers: [{path, error}],
              started_at, duration_s, blocking}   (`blocking` true means launches are
              refused until fixed — the reply is still ok)
    CLI      lockstep admin reap
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages.base import TEXT


@dataclass
class Args:
    pass


@dataclass(frozen=True)
class ReapFailure:
    job_id: str
    reason: str = field(metadata=TEXT)
    survivors: list[dict[str, object]] = field(default_factory=list)


@dataclass(frozen=True)
class Unreadable:
    path: str
    error: str = field(metadata=TEXT)


@dataclass(frozen=True)
class ReapReport:
    """One reap pass (services/reaper/reap.py writes it): also `status.reaper` and the
    data of a `reap_blocked` refusal."""

    reaped: list[str] = field(default_factory=list)  # job ids, every exit proven
    active: list[str] = field(default_factory=list)  # job ids of live supervisors
    # job id -> why it is left alone: its `up` is restarting the supervisor, which may
    # adopt it (services/reaper/adoption_window.py)
    awaiting_adoption: dict[str, str] = field(default_factory=dict)
    failures: list[ReapFailure] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)  # launch manifests
    steps: dict[str, list[str]] = field(default_factory=dict)  # job id -> ladder steps
    retired_markers: list[str] = field(default_factory=list)  # deployment ids
    unreadable_markers: list[Unreadable] = field(default_factory=list)  # informative
    started_at: float = 0.0
    duration_s: float = 0.0
    blocking: bool = False  # a new launch must not start: a failure or an unreadable manifest

    def render(self) -> str:
        lines = [f"reaped {self.reaped or 'none'}; active {self.active or 'none'}"]
        lines += [f"  AWAITING ADOPTION {j}: {why}" for j, why in self.awaiting_adoption.items()]
        lines += [f"  FAILED {f.job_id}: {f.reason}" for f in self.failures]
        lines += [f"  UNREADABLE {u.path}: {u.error}" for u in self.unreadable]
        return "\n".join(lines)


Reply = ReapReport
