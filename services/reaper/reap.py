"""One reap pass: orphaned launches, stale markers, reused-PID safety (DESIGN 5.8).

For each launch manifest under `runtime/manifests/`:
  - supervisor alive (pid exists, not a zombie, start time matches) → the job is
    *active* and nothing of it is touched;
  - otherwise its ranks are reaped: a rank pid is signalled only while pid + start time
    + command line prove it is that rank, a process group only while a recorded rank
    still lives in it (a reused pgid is never signalled); SIGTERM → wait → SIGKILL →
    wait → SIGKILL → prove exit. A pid now held by a process with another start time is
    an exited rank; one with the same start time but another command line is ambiguous
    and is neither signalled nor called gone. Proven: manifest, launch secret and (when no live
    owner remains) the deployment's markers are removed. Not proven: the manifest is
    kept with the failure appended to `teardown_failures`, and the pass is *blocking*.
A manifest that cannot be read is reported with its path and error and blocks launches;
nothing is guessed from it. Finally a marker directory whose every owner is dead and
that no remaining manifest names is retired.

Passes are serialised by an flock on `runtime/state/reap.lock`: the reaper service and a
supervisor may run one at the same moment, and a late failure record must never
resurrect a manifest that the other pass has just removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.home import Paths, read_manifests, remove_manifest, write_manifest
from common.messages import Event, EventName, EventTopic, ReapOutcome
from common.procs import (
    START_TIME_TOLERANCE,
    Kill,
    ProcessIdentity,
    identify,
    terminate_ladder,
)
from common.records import LaunchManifest, RankRecord
from services.reaper.adoption_window import AdoptionWindow, live_record
from services.reaper.markers import protected_deployments, sweep_markers

log = logging.getLogger("lockstep.reaper")

MAX_FAILURE_RECORDS = 20  # per manifest: retried every pass, so keep only the latest
REMOTE_UNAVAILABLE = "remote reap not available yet"


@dataclass
class RemoteOutcome:
    survivors: list[dict[str, Any]]  # {rank, host, pid, reason?}; empty: every exit proven
    path: list[str] = field(default_factory=list)  # ladder steps taken on any host


class RemoteReaper(Protocol):
    """Seam for ranks reached over ssh (`services.reaper.remote.SshRemoteReaper`): stop
    them with the same proof rules and return the survivors as `{rank, host, pid}` dicts
    (empty: every exit proven), or a RemoteOutcome that also names the steps taken."""

    def __call__(self, manifest: LaunchManifest, ranks: list[RankRecord], *,
                 term_timeout: float, kill_timeout: float
                 ) -> list[dict[str, Any]] | RemoteOutcome: ...


Publish = Callable[[Event], None]


class ReapLockTimeout(Exception):
    pass


@dataclass
class ReapReport:
    reaped: list[str] = field(default_factory=list)  # job ids, every exit proven
    active: list[str] = field(default_factory=list)  # job ids of live supervisors
    # job id -> why it waits for a restarted supervisor to adopt it (adoption_window.py)
    awaiting_adoption: dict[str, str] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # {job_id, reason, survivors}
    unreadable: list[dict[str, str]] = field(default_factory=list)  # {path, error}
    steps: dict[str, list[str]] = field(default_factory=dict)  # job id -> ladder steps taken
    retired_markers: list[str] = field(default_factory=list)  # deployment ids
    unreadable_markers: list[dict[str, str]] = field(default_factory=list)  # informative
    started_at: float = 0.0
    duration_s: float = 0.0

    @property
    def blocking(self) -> bool:
        """True when a new launch must not start: a reap failed or a manifest is unreadable."""
        return bool(self.failures or self.unreadable)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["blocking"] = self.blocking
        return d

    def blockers(self) -> str:
        """One human line per blocker, naming each file and job: for launch errors."""
        lines = [f"unreadable launch manifest {u['path']}: {u['error']} "
                 f"(fix or remove the file)" for u in self.unreadable]
        lines += [f"job {f['job_id']} not reaped: {f['reason']}" for f in self.failures]
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"reaped={self.reaped} active={self.active} "
                f"awaiting_adoption={sorted(self.awaiting_adoption)} failures={len(self.failures)} "
                f"unreadable={len(self.unreadable)} retired_markers={self.retired_markers} "
                f"({self.duration_s:.2f}s)")


# --- liveness -----------------------------------------------------------------------


def supervisor_state(manifest: LaunchManifest) -> tuple[bool, str]:
    """(alive, why): alive only if the recorded supervisor pid still runs with the
    recorded start time."""
    current = identify(manifest.supervisor_pid)
    if current is None:
        return False, f"supervisor pid {manifest.supervisor_pid} is gone"
    if abs(current.start_time - manifest.supervisor_start_time) > START_TIME_TOLERANCE:
        return False, (f"supervisor pid {manifest.supervisor_pid} was reused "
                       f"(start time {current.start_time:.2f} != "
                       f"{manifest.supervisor_start_time:.2f})")
    return True, f"supervisor pid {manifest.supervisor_pid} alive"


def _rank_identity(r: RankRecord) -> ProcessIdentity:
    return ProcessIdentity(r.pid, r.start_time, tuple(r.cmdline))


def _ambiguous(r: RankRecord) -> str | None:
    """Why a live process can be neither proven to be this rank nor proven another one.

    The start time (1/100 s) tells processes apart; the command line confirms. A running
    process with the recorded pid *and* start time but another command line is almost
    surely this rank recorded badly (e.g. read mid-exec, when /proc shows an empty
    command line): signalling it would go beyond the proof, calling it gone would leak
    it. An empty current command line is a process exiting: the ladder handles it."""
    current = identify(r.pid)
    if (current is None or not current.cmdline
            or abs(current.start_time - r.start_time) > START_TIME_TOLERANCE
            or current.cmdline == tuple(r.cmdline)):
        return None
    return (f"identity ambiguous: start time matches but the command line differs "
            f"(recorded {r.cmdline[:3]!r}, now {list(current.cmdline[:3])!r})")


def _describe(r: RankRecord) -> dict[str, Any]:
    return {"rank": r.rank, "host": r.host, "pid": r.pid}


# --- one manifest ---------------------------------------------------------------------


@dataclass
class _JobOutcome:
    survivors: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    path: list[str] = field(default_factory=list)


def _reap_job(manifest: LaunchManifest, *, term_timeout: float, kill_timeout: float,
              kill: Kill | None, remote: RemoteReaper | None) -> _JobOutcome:
    out = _JobOutcome()
    local = [r for r in manifest.ranks if not r.remote]
    remote_ranks = [r for r in manifest.ranks if r.remote]
    ambiguous = [(r, why) for r in local if (why := _ambiguous(r)) is not None]
    for r, why in ambiguous:
        out.survivors.append(_describe(r))
        out.reasons.append(f"rank {r.rank} pid {r.pid}: {why}; not signalled, not proven gone")
    skip = {(r.rank, r.pid) for r, _ in ambiguous}
    local = [r for r in local if (r.rank, r.pid) not in skip]
    if local:
        by_pid = {r.pid: r for r in local}
        ladder = terminate_ladder([_rank_identity(r) for r in local],
                                  sorted({r.pgid for r in local}),
                                  term_timeout=term_timeout, kill_timeout=kill_timeout, kill=kill)
        out.path = ladder.path
        for ident in ladder.survivors:
            out.survivors.append(_describe(by_pid[ident.pid]))
        if ladder.survivors:
            pids = ", ".join(str(i.pid) for i in ladder.survivors)
            out.reasons.append(f"local rank pid(s) {pids} survived {' → '.join(ladder.path)}")
    if remote_ranks:
        if remote is None:
            out.survivors += [_describe(r) for r in remote_ranks]
            hosts = sorted({r.host for r in remote_ranks})
            out.reasons.append(f"{REMOTE_UNAVAILABLE}: rank(s) "
                               f"{[r.rank for r in remote_ranks]} on {', '.join(hosts)}")
        else:
            try:
                left = remote(manifest, remote_ranks, term_timeout=term_timeout,
                              kill_timeout=kill_timeout)
            except Exception as exc:  # noqa: BLE001 - any remote error is "not proven"
                left = [_describe(r) for r in remote_ranks]
                out.reasons.append(f"remote reap failed: {type(exc).__name__}: {exc}")
            else:
                if isinstance(left, RemoteOutcome):
                    taken = set(out.path) | set(left.path)
                    out.path = [s for s in ("sigterm", "sigkill", "sigkill-retry") if s in taken]
                    left = left.survivors
                if left:
                    out.reasons.append(f"remote rank(s) survived: {left}")
            out.survivors += list(left)
    return out


def _record_failure(paths: Paths, manifest: LaunchManifest, reason: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    records = [*manifest.teardown_failures, f"{stamp}Z reaper: {reason}"]
    updated = dataclasses.replace(manifest, teardown_failures=records[-MAX_FAILURE_RECORDS:])
    write_manifest(paths, updated)


def _remove_secret(paths: Paths, manifest: LaunchManifest) -> None:
    if not manifest.secret_path:
        return
    secret = Path(manifest.secret_path)
    # Only ever delete inside runtime/secrets: a path read from a file is not a licence.
    if secret.parent.resolve() != paths.secrets.resolve():
        log.warning("job %s: secret %s is outside %s; left in place",
                    manifest.job_id, secret, paths.secrets)
        return
    try:
        secret.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # the launch is reaped; a leftover key opens nothing running
        log.error("job %s: could not remove its secret %s: %s", manifest.job_id, secret, exc)


# --- the pass -------------------------------------------------------------------------


@contextlib.contextmanager
def _pass_lock(paths: Paths, timeout: float) -> Iterator[None]:
    lock_path = paths.state / "reap.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ReapLockTimeout(
                        f"another reap pass held {lock_path} for {timeout:.0f}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _emit(publish: Publish | None, event: Event) -> None:
    if publish is None:
        return
    try:
        publish(event)
    except Exception:  # noqa: BLE001 - events are best effort; the report is the truth
        log.exception("publishing reap event %s failed", event.name)


def reap_orphans(paths: Paths, *, term_timeout: float = 5.0, kill_timeout: float = 5.0,
                 kill: Kill | None = None, remote: RemoteReaper | None = None,
                 publish: Publish | None = None,
                 lock_timeout: float | None = None, honour_adoption: bool = True,
                 window: AdoptionWindow | None = None) -> ReapReport:
    """One reap pass over `paths`; see the module docstring. Never raises for what it
    finds on disk: everything lands in the report (`.blocking` gates launches).
    `honour_adoption`: leave orphans alone while `up` may adopt them (adoption_window.py;
    a supervisor's own passes do not: it tried to adopt them at its start); `window`
    carries the periodic reaper's memory of when each was first seen orphaned."""
    adopt = (window or AdoptionWindow()) if honour_adoption else None
    report = ReapReport(started_at=time.time())
    t0 = time.monotonic()
    if lock_timeout is None:
        lock_timeout = 2 * (term_timeout + 2 * kill_timeout) + 30.0
    try:
        paths.ensure()
        with _pass_lock(paths, lock_timeout):
            _reap_all(paths, report, term_timeout=term_timeout, kill_timeout=kill_timeout,
                      kill=kill, remote=remote, publish=publish, adopt=adopt)
    except (ReapLockTimeout, OSError) as exc:  # no pass: that blocks launches too
        report.failures.append({"job_id": "", "reason": f"reap pass failed: {exc}",
                                "survivors": []})
        log.error("reap pass failed: %s", exc)
    report.duration_s = time.monotonic() - t0
    _emit(publish, Event(topic=EventTopic.REAP, name=EventName.PASS, deployment_id="",
                         state=None, reason=report.summary(), at=time.time(),
                         data=report.to_dict(),
                         outcome=ReapOutcome.BLOCKED if report.blocking else ReapOutcome.OK))
    return report


def _reap_all(paths: Paths, report: ReapReport, *, term_timeout: float, kill_timeout: float,
              kill: Kill | None, remote: RemoteReaper | None, publish: Publish | None,
              adopt: AdoptionWindow | None = None) -> None:
    scan = read_manifests(paths)
    record = live_record(paths) if adopt is not None else None
    for path, error in scan.unreadable:
        report.unreadable.append({"path": str(path), "error": error})
        log.error("unreadable launch manifest %s: %s", path, error)
        _emit(publish, Event(topic=EventTopic.REAP, name=EventName.MANIFEST_UNREADABLE,
                             deployment_id="", state=None, reason=f"{path}: {error}",
                             at=time.time(), data={"path": str(path), "error": error},
                             outcome=ReapOutcome.BLOCKED))
    for path, manifest in scan.manifests:
        if adopt is not None and not supervisor_state(manifest)[0]:
            why = adopt.waits(record, manifest.job_id, time.monotonic(), time.time())
            if why is not None:
                report.awaiting_adoption[manifest.job_id] = why
                log.info("job %s left for adoption: %s", manifest.job_id, why)
                continue
        try:
            _reap_one(paths, path, manifest, report, term_timeout=term_timeout,
                      kill_timeout=kill_timeout, kill=kill, remote=remote, publish=publish)
        except OSError as exc:  # e.g. the manifest cannot be removed: not resolved
            report.failures.append({"job_id": manifest.job_id, "survivors": [],
                                    "reason": f"{path}: {exc}"})
            log.error("job %s: %s: %s", manifest.job_id, path, exc)
    if adopt is not None:
        adopt.forget(set(report.awaiting_adoption))
    protected = protected_deployments(paths)
    if protected is None:
        return  # a manifest we cannot read may name any deployment: retire nothing
    sweep_markers(paths, protected, report)


def _reap_one(paths: Paths, path: Path, manifest: LaunchManifest, report: ReapReport, *,
              term_timeout: float, kill_timeout: float, kill: Kill | None,
              remote: RemoteReaper | None, publish: Publish | None) -> None:
    alive, why = supervisor_state(manifest)
    if alive:
        report.active.append(manifest.job_id)
        return
    log.warning("job %s (deployment %s): %s; reaping %d rank(s)", manifest.job_id,
                manifest.deployment_id, why, len(manifest.ranks))
    out = _reap_job(manifest, term_timeout=term_timeout, kill_timeout=kill_timeout,
                    kill=kill, remote=remote)
    if out.reasons:
        reason = f"{why}; " + "; ".join(out.reasons)
        report.failures.append({"job_id": manifest.job_id, "reason": reason,
                                "survivors": out.survivors})
        report.steps[manifest.job_id] = out.path
        log.error("job %s not reaped: %s", manifest.job_id, reason)
        try:
            _record_failure(paths, manifest, reason)
        except (OSError, ValueError) as exc:
            log.error("job %s: could not record the failure in %s: %s",
                      manifest.job_id, path, exc)
        _emit(publish, Event(topic=EventTopic.REAP, name=EventName.REAP_FAILED,
                             deployment_id=manifest.deployment_id, state=None,
                             reason=reason, at=time.time(),
                             data={"job_id": manifest.job_id, "survivors": out.survivors},
                             outcome=ReapOutcome.FAILED))
        return
    remove_manifest(paths, manifest.job_id)
    _remove_secret(paths, manifest)
    report.reaped.append(manifest.job_id)
    report.steps[manifest.job_id] = out.path
    log.warning("job %s reaped: %d rank(s), steps %s", manifest.job_id,
                len(manifest.ranks), out.path or ["none alive"])
    _emit(publish, Event(topic=EventTopic.REAP, name=EventName.REAPED,
                         deployment_id=manifest.deployment_id, state=None, reason=why,
                         at=time.time(), data={"job_id": manifest.job_id,
                                               "ranks": len(manifest.ranks), "path": out.path},
                         outcome=ReapOutcome.REAPED))
