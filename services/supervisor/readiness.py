"""The readiness barrier (DESIGN.md 5.4): every rank must show a rank-ready marker *and*
a rank_ready report, both naming the pid and start time recorded in the manifest; then
`serve` is released (re-sent until every rank reports `serving`). Bounded by
load_timeout; a rank that dies or reports `failed` ends the wait with its own error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.home import Paths, read_markers
from common.messages import DEAD_PHASES, Phase, Serve
from common.procs import START_TIME_TOLERANCE, identify
from common.records import RankMarker
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.errors import LaunchError
from services.supervisor.process_launcher import log_tail

POLL_S = 0.05
READY_PHASES = frozenset({Phase.READY, Phase.SERVING})
ENDED_PHASES = DEAD_PHASES | {Phase.EXITING}  # during a launch, exiting is a failure too


def _same(rs: RankState, pid: int, start_time: float) -> bool:
    return (rs.identity is not None and rs.identity.pid == pid
            and abs(rs.identity.start_time - start_time) <= START_TIME_TOLERANCE)


def own_markers(paths: Paths, dep: Deployment) -> dict[int, RankMarker]:
    """This launch's markers whose identity matches the manifest, by rank: read here for
    local ranks; for a remote rank, the one last read on its host (`remote_watch`)."""
    out = {}
    for _, m in read_markers(paths, dep.deployment_id).markers:
        rs = dep.ranks.get(m.rank)
        if (rs is not None and rs.remote is None and m.job_id == dep.job_id
                and _same(rs, m.pid, m.start_time)):
            out[m.rank] = m
    for rs in dep.ranks.values():
        m = rs.remote_marker
        if rs.remote is not None and m is not None and m.job_id == dep.job_id and _same(
                rs, m.pid, m.start_time):
            out[rs.rank] = m
    return out


def rank_failure(dep: Deployment, markers: dict[int, RankMarker]) -> LaunchError | None:
    """The first rank that exited or reported a terminal phase, as a LaunchError."""
    for rs in dep.ranks.values():
        m = markers.get(rs.rank)
        code = rs.popen.poll() if rs.popen is not None else None
        dead = rs.exited
        phase = m.phase if m else rs.phase
        if dead or phase in ENDED_PHASES:
            why = (m.error if m and m.error else None) or rs.error
            if not why and rs.remote is None:
                tail = log_tail(rs.log_path, 400).splitlines()
                why = tail[-1] if tail else "no error recorded"
            elif not why:
                why = f"see {rs.log_path} on {rs.remote.describe()}"
            now = "over ssh" if rs.remote is not None else f"now {identify(rs.pid)}"
            what = f"exited with code {code}" if code is not None else (
                f"is gone ({now})" if dead else f"reported {phase}")
            where = f" on {rs.remote.describe()}" if rs.remote is not None else ""
            return LaunchError(f"rank {rs.rank} (pid {rs.pid}{where}) {what} during load "
                               f"(phase {phase}): {why}", rank=rs.rank)
    return None


async def wait_ready(dep: Deployment, paths: Paths, timeout: float,
                     aborted: Callable[[], str | None]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        markers = own_markers(paths, dep)
        for r, m in markers.items():
            dep.ranks[r].on_marker(m.phase)
        err = rank_failure(dep, markers)
        if err is not None:
            raise err
        if (why := aborted()) is not None:
            raise LaunchError(f"launch aborted: {why}")
        missing = []
        for rs in dep.ranks.values():
            m = markers.get(rs.rank)
            ready = rs.ready is not None and _same(rs, rs.ready.pid, rs.ready.start_time)
            if m is None or m.phase not in READY_PHASES or not ready:
                missing.append(f"rank {rs.rank}: marker "
                               f"{m.phase.value if m else 'missing'}, rank_ready "
                               f"{'received' if ready else 'missing'}"
                               + (f" (last probe of {rs.remote.describe()} failed: "
                                  f"{rs.remote_error})" if rs.remote_error else ""))
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise LaunchError(f"not ready within {timeout:.0f}s (LOCKSTEP_LOAD_TIMEOUT): "
                              + "; ".join(missing))
        await asyncio.sleep(POLL_S)


async def release_serve(dep: Deployment, paths: Paths, publish: Callable[[object], None],
                        timeout: float, aborted: Callable[[], str | None]) -> None:
    """Publish SERVE until every rank reports `serving` (telemetry or marker)."""
    deadline = time.monotonic() + timeout
    body = Serve(deployment_id=dep.deployment_id, job_id=dep.job_id)
    next_send = 0.0
    while True:
        now = time.monotonic()
        if now >= next_send:
            publish(body)
            next_send = now + 0.25
        markers = own_markers(paths, dep)
        for r, m in markers.items():
            if m.phase == Phase.SERVING:
                dep.ranks[r].on_marker(Phase.SERVING)
        err = rank_failure(dep, markers)
        if err is not None:
            raise err
        if (why := aborted()) is not None:
            raise LaunchError(f"launch aborted: {why}")
        waiting = [rs.rank for rs in dep.ranks.values() if rs.phase != Phase.SERVING]
        if not waiting:
            return
        if now >= deadline:
            raise LaunchError(f"rank(s) {waiting} did not start serving within {timeout:.0f}s "
                              "after serve was released")
        await asyncio.sleep(POLL_S)
