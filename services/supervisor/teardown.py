"""Verified teardown (DESIGN.md 5.7): graceful shutdown on control → SIGTERM to each
rank's process group → wait (stop_timeout) → SIGKILL → wait → SIGKILL once more → sweep
leftover ranks by marker pid → prove exit with psutil. Ranks on remote hosts take the
same steps over ssh (`teardown_remote`, one thread per host, alongside the local ones);
`outcome.hosts` records each remote host's path, and an ssh failure there leaves its
ranks unproven (survivors naming the host and the failure).

Every signal goes through `common.procs`, which signals a pid only while its start time
and command line still match the record, and a group only while a recorded member still
lives in it. The marker sweep signals a marker's pid only if the process there has the
marker's start time *and* a command line naming this launch's job; anything else at that
pid is left alone and listed in `skipped`. Seams: `kill` (called instead of the real
kill, after the identity checks), `clock` and `sleep`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.home import Paths, read_markers
from common.procs import (
    START_TIME_TOLERANCE,
    Kill,
    ProcessIdentity,
    identify,
    is_alive,
    terminate_ladder,
)
from services.supervisor import teardown_remote as tr
from services.supervisor.deployment import Deployment

GRACEFUL_RESEND_S = 0.25
GRACEFUL_POLL_S = 0.02
SWEEP_TERM_S = 0.2


@dataclass
class TeardownOutcome:
    path: list[str] = field(default_factory=list)  # steps taken, in order
    survivors: list[dict[str, Any]] = field(default_factory=list)  # {rank, pid, host}
    swept: list[dict[str, Any]] = field(default_factory=list)  # found via markers
    skipped: list[dict[str, Any]] = field(default_factory=list)  # marker pids not ours
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)  # remote: {path, error}
    duration_s: float = 0.0

    @property
    def proven(self) -> bool:
        return not self.survivors

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "survivors": self.survivors, "swept": self.swept,
                "skipped": self.skipped, "hosts": self.hosts,
                "duration_s": round(self.duration_s, 4),
                "proven": self.proven}


@dataclass
class TeardownSeams:
    kill: Kill | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def _names_launch(ident: ProcessIdentity, job_id: str) -> bool:
    """The command line is a rank's (`--spec FILE`) and its spec file is this job's."""
    return tr.names_launch(list(ident.cmdline), job_id)


def _reap_children(dep: Deployment) -> None:
    for r in dep.ranks.values():
        if r.popen is not None:
            r.popen.poll()  # our own children: collect zombies


def _marker_leftovers(paths: Paths, dep: Deployment, known: set[int],
                      out: TeardownOutcome) -> list[tuple[int, ProcessIdentity]]:
    try:
        scan = read_markers(paths, dep.deployment_id)
    except ValueError:
        return []
    found = []
    members = dep.plan.members
    for _, m in scan.markers:
        if m.pid in known or (m.rank < len(members) and not members[m.rank].local):
            continue  # a remote rank's marker (a shared home): swept over ssh, there
        ident = identify(m.pid)
        if ident is None:
            continue  # exited (or a zombie): nothing to do, never signalled
        if abs(ident.start_time - m.start_time) > START_TIME_TOLERANCE:
            out.skipped.append({"rank": m.rank, "pid": m.pid, "reason": "pid reused: start "
                                f"time {ident.start_time:.2f} != marker {m.start_time:.2f}"})
            continue
        if not _names_launch(ident, m.job_id) or m.job_id != dep.job_id:
            out.skipped.append({"rank": m.rank, "pid": m.pid,
                                "reason": "command line does not name this launch"})
            continue
        found.append((m.rank, ident))
    return found


def _merged_path(*paths: list[str]) -> list[str]:
    taken = {step for p in paths for step in p}
    return [step for step, _ in tr.STEPS if step in taken]


async def verified_teardown(dep: Deployment, paths: Paths, *, publish_shutdown: Callable[[], None],
                            graceful_s: float, stop_timeout: float, kill_timeout: float,
                            seams: TeardownSeams | None = None) -> TeardownOutcome:
    seams = seams or TeardownSeams()
    out = TeardownOutcome()
    t0 = time.monotonic()
    local = [r for r in dep.ranks.values() if r.remote is None]
    by_pid = {r.pid: r for r in local if r.identity is not None}
    targets = [r.identity for r in local if r.identity is not None]
    pgids = sorted({r.pgid for r in local if r.pgid > 1})
    hosts = [tr.HostTeardown.of(host, [dep.ranks[m.index] for m in dep.plan.members
                                       if m.host_index == hi and m.index in dep.ranks])
             for hi, host in dep.remote_hosts.items()]

    alive = [t for t in targets if is_alive(t)]
    if (alive or any(h.left for h in hosts)) and graceful_s > 0:
        out.path.append("shutdown")
        waits = [asyncio.ensure_future(asyncio.to_thread(tr.wait_gone, h, graceful_s))
                 for h in hosts]
        deadline = time.monotonic() + graceful_s
        next_send = 0.0
        while (alive or not all(w.done() for w in waits)) and time.monotonic() < deadline:
            if time.monotonic() >= next_send:  # PUB may drop it: re-send until they go
                publish_shutdown()
                next_send = time.monotonic() + GRACEFUL_RESEND_S
            await asyncio.sleep(min(GRACEFUL_POLL_S, max(0.0, deadline - time.monotonic())))
            _reap_children(dep)
            alive = [t for t in alive if is_alive(t)]
        await asyncio.gather(*waits)  # each ends within graceful_s + its ssh deadline

    def local_ladder() -> list[str]:
        if not alive:
            return []
        return terminate_ladder(alive, pgids, term_timeout=stop_timeout,
                                kill_timeout=kill_timeout, kill=seams.kill, clock=seams.clock,
                                sleep=seams.sleep).path

    results = await asyncio.gather(
        asyncio.to_thread(local_ladder),
        *(asyncio.to_thread(tr.ladder, h, stop_timeout, kill_timeout) for h in hosts))
    out.path += _merged_path(*results[:1], *(h.path for h in hosts))
    _reap_children(dep)

    leftovers = _marker_leftovers(paths, dep, set(by_pid), out)
    swept_rank: dict[int, int] = {}
    if leftovers:
        ladder = await asyncio.to_thread(
            terminate_ladder, [i for _, i in leftovers], [], term_timeout=SWEEP_TERM_S,
            kill_timeout=kill_timeout, kill=seams.kill, clock=seams.clock, sleep=seams.sleep)
        out.swept = [{"rank": r, "pid": i.pid, "path": ladder.path} for r, i in leftovers]
        targets = targets + [i for _, i in leftovers]
        swept_rank = {i.pid: r for r, i in leftovers}
    # Remote: one probe per host is both the marker sweep and the proof there.
    await asyncio.gather(*(asyncio.to_thread(tr.sweep_and_prove, h, dep.deployment_id,
                                             dep.job_id, kill_timeout) for h in hosts))
    if leftovers or any(h.swept for h in hosts):
        out.path.append("sweep")
    for h in hosts:
        out.swept += h.swept
        out.skipped += h.skipped
        out.hosts[h.host.name] = h.report()

    # Proof: observed, never assumed. A zombie has exited (procs.is_alive says so).
    _reap_children(dep)
    for ident in targets:
        if is_alive(ident):
            rs = by_pid.get(ident.pid)
            out.survivors.append({"rank": rs.rank if rs else swept_rank.get(ident.pid),
                                  "pid": ident.pid, "host": rs.host if rs else "",
                                  "cmdline": list(ident.cmdline)})
    for h in hosts:
        out.survivors += tr.survivors(h)
    out.duration_s = time.monotonic() - t0
    return out
