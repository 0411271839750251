"""Adoption: a restarted supervisor takes over the launches its predecessor left serving,
instead of reaping them (DESIGN.md 5.8, docs/supervisor.md "Adoption").

At start, before its admin socket answers and before its first reap, the supervisor
looks at every manifest whose supervisor is dead:

    manifest + the job's deploy record + the launch secret (all on this host, 0600)
      → not adoptable (reaped as before, by the reap that follows) when: a teardown
        already failed on it, its files are missing or unreadable, it names fewer ranks
        than its plan, a local rank is no longer the recorded process, or a rank's
        marker does not say `serving`
      → rebuilt: the plan re-made from the deploy record, the keys from the secret,
        rank 0's endpoints from its spec, each rank's identity from the manifest; the
        manifest rewritten with this supervisor (the reaper now sees a live owner);
        the control/report endpoints its remote ranks reach bound again
      → proven: leases flow (fast, as during a launch); each rank re-authenticates on
        the report socket (the session handshake: proof of the launch's secret for its
        rank) and re-sends RANK_READY, whose pid and start time must be the manifest's;
        its marker (identity-checked) says serving; SERVE is released again; one canary
      → serving, within `adopt_timeout`; otherwise torn down with proof (`failed`), the
        rejection counted and named (an incident), and `up` redeploys.

The gateway keeps streaming through all this (rank 0 never stopped). The admin socket
is answered only after the adoption pass, so nobody sees a half-adopted deployment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.bus import Channel
from common.home import read_manifests, write_manifest
from common.keys import KeyFileError, LaunchKeys, read_secret_file
from common.messages import REPORT, EventName, Phase
from common.procs import ProcessIdentity, is_alive
from common.rankspec import RankSpec
from common.records import LaunchManifest
from common.sampling_defaults import SamplingOverrides
from services.reaper.reap import supervisor_state
from services.supervisor import job_launch, readiness, remote_watch
from services.supervisor.canary import run_canary
from services.supervisor.deployment import Deployment, LaunchSetup
from services.supervisor.deployment_state import Claim
from services.supervisor.deployment_state import DeploymentState as S
from services.supervisor.errors import AdminError, LaunchError, TeardownError
from services.supervisor.plan import make_plan
from services.supervisor.remote import hosts_of

if TYPE_CHECKING:
    from services.supervisor.interfaces import AdoptionHost as Supervisor

log = logging.getLogger("lockstep.supervisor.adoption")


class NotAdoptable(Exception):
    """Why a launch cannot be adopted (it is reaped instead)."""


@dataclasses.dataclass
class AdoptionReport:
    adopted: list[str] = dataclasses.field(default_factory=list)  # deployment ids
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # job id -> why
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # dep id -> why

    def to_wire(self) -> dict:
        return {"adopted": list(self.adopted), "rejected": dict(self.rejected),
                "failed": dict(self.failed)}


def orphans(sup: Supervisor) -> list[LaunchManifest]:
    """Manifests whose supervisor is dead (not this one: it just started)."""
    return [m for _, m in read_manifests(sup.paths).manifests
            if not supervisor_state(m)[0] and m.supervisor_pid != sup.me.pid]


def rebuild(sup: Supervisor, manifest: LaunchManifest) -> Deployment:
    """The deployment as its predecessor had it, from the files it left; NotAdoptable."""
    if manifest.teardown_failures:
        raise NotAdoptable(f"a teardown already failed on it ({manifest.teardown_failures[-1]})")
    jd = job_launch.job_dir(sup.paths, manifest.job_id)
    try:
        args = json.loads((jd / job_launch.DEPLOY_RECORD).read_text())
        secret = read_secret_file(Path(manifest.secret_path))
        specs = {r: RankSpec.load(jd / f"rank-{r}.spec.json") for r in range(len(manifest.ranks))}
    except (OSError, ValueError, KeyFileError) as exc:
        raise NotAdoptable(f"its launch files: {exc}") from None
    try:
        sampling = None if args["sampling"] is None else SamplingOverrides(**args["sampling"])
        plan = make_plan(args["model_path"], args["tp"], args["pp"], args["hosts"],
                         args["backend"], args["envs"], sampling, replica=args["replica"],
                         replicas=args["replicas"])
    except (KeyError, TypeError, AdminError) as exc:
        raise NotAdoptable(f"its deploy record: {exc}") from None
    records = sorted(manifest.ranks, key=lambda r: r.rank)
    if [r.rank for r in records] != list(range(plan.world_size)):
        raise NotAdoptable(f"its manifest names ranks {[r.rank for r in records]} of "
                           f"{plan.world_size} (a launch that never completed)")
    for r in records:
        if not r.remote and not is_alive(ProcessIdentity(r.pid, r.start_time, tuple(r.cmdline))):
            raise NotAdoptable(f"rank {r.rank} (pid {r.pid}) is gone")
    s0 = specs[0]
    if s0.deployment_id != manifest.deployment_id or s0.job_id != manifest.job_id:
        raise NotAdoptable("rank 0's spec names another launch")
    dep = Deployment(manifest.deployment_id, manifest.job_id, plan, initial=S.ADOPTING)
    remote = hosts_of(plan.members, sup.remote_launcher)
    dep.placed(remote)
    endpoints = {}
    for r, spec in specs.items():
        if not plan.members[r].local:
            endpoints[r] = (spec.control_endpoint, spec.report_endpoint)
    me = sup.me
    keys = LaunchKeys(secret, manifest.deployment_id, manifest.job_id)
    mine = dataclasses.replace(manifest, supervisor_pid=me.pid,
                               supervisor_start_time=me.start_time,
                               supervisor_boot_id=me.boot_id)
    dep.launched(LaunchSetup(
        job_dir=jd, secret_path=Path(manifest.secret_path), keys=keys,
        control=Channel("supervisor", "control", sender=me.sender, send_key=keys.control),
        report=Channel("supervisor", "report", sender=me.sender, send_key=keys.report,
                       accept=REPORT),
        plan_endpoint=s0.plan_endpoint, requests_endpoint=s0.requests_endpoint,
        rank_endpoints=endpoints), mine)
    dep.ranks_planned()
    for r in records:
        m = plan.members[r.rank]
        host = None if m.local else remote[m.host_index]
        log_path = (host.paths.logs if host else sup.paths.logs) / f"{dep.job_id}-rank{r.rank}.log"
        dep.ranks[r.rank].started(ProcessIdentity(r.pid, r.start_time, tuple(r.cmdline)),
                                  r.pgid, None, host, log_path)
    return dep


def _markers_serving(sup: Supervisor, dep: Deployment) -> None:
    """Local ranks' markers (identity-checked) must say serving; remote ones are checked
    by the proof itself (their host's marker comes with the remote watch)."""
    markers = readiness.own_markers(sup.paths, dep)
    for rs in dep.ranks.values():
        if rs.remote is not None:
            continue
        m = markers.get(rs.rank)
        if m is None or m.phase != Phase.SERVING:
            raise NotAdoptable(f"rank {rs.rank}'s marker says "
                               f"{m.phase.value if m else 'nothing for its pid'}, not serving")


async def adopt_all(sup: Supervisor) -> AdoptionReport:
    """One adoption pass; every candidate concurrently, each bounded by adopt_timeout."""
    report = AdoptionReport()
    tasks = []
    for manifest in orphans(sup):
        try:
            dep = rebuild(sup, manifest)
            _markers_serving(sup, dep)
            for ctl, rep in dep.rank_endpoints.values():
                sup.sockets.bind_rank_endpoints(ctl, rep)
        except (NotAdoptable, OSError) as exc:
            why = str(exc)
            report.rejected[manifest.job_id] = why
            sup.adoption_rejections["not_adoptable" if isinstance(exc, NotAdoptable)
                                    else "unreadable"] += 1
            log.warning("launch %s (%s) not adopted: %s; it is reaped", manifest.job_id,
                        manifest.deployment_id, why)
            continue
        if dep.deployment_id in sup.deployments:
            report.rejected[manifest.job_id] = "its deployment id is taken"
            continue
        write_manifest(sup.paths, dep.manifest)  # ours now: the reaper sees a live owner
        tasks.append(asyncio.create_task(_adopt(sup, dep, report)))
    if tasks:
        await asyncio.gather(*tasks)
    return report


async def _adopt(sup: Supervisor, dep: Deployment, report: AdoptionReport) -> None:
    s = sup.settings
    t0 = time.monotonic()
    dep.life.claim(Claim.ADOPT)
    sup.deployments[dep.deployment_id] = dep
    sup.sockets.add_report_route(dep.keys.report, dep.report, dep)
    if any(rs.remote is not None for rs in dep.ranks.values()):
        dep.watching_remote(sup.spawn(remote_watch.watch(dep, s.remote_poll_s)))
    log.info("adopting %s (job %s, %d ranks): waiting for each rank's proof", dep.deployment_id,
             dep.job_id, dep.world_size)
    try:
        try:
            deadline = t0 + s.adopt_timeout
            await readiness.wait_ready(dep, sup.paths, s.adopt_timeout, lambda: dep.abort_reason)
            await readiness.release_serve(dep, sup.paths, lambda b: sup.publish_dep(dep, b),
                                          max(1.0, deadline - time.monotonic()),
                                          lambda: dep.abort_reason)
            tokens = await run_canary(dep, sup.ctx, sup.me.sender, runs=1, window_s=0.0,
                                      tokens=s.canary_tokens,
                                      timeout=max(1.0, deadline - time.monotonic()),
                                      aborted=lambda: dep.abort_reason)
        except LaunchError as exc:
            await _reject(sup, dep, f"adoption failed: {exc}", report)
            return
        dep.canary_passed()
        dep.life.release()
        took = time.monotonic() - t0
        why = (f"adopted by a restarted supervisor in {took:.2f}s: {dep.world_size} rank(s) "
               f"proved themselves; canary tokens {tokens}")
        sup.set_state(dep, S.SERVING, why)
        sup.incident(dep, EventName.ADOPTED, why, {"job_id": dep.job_id, "took_s": took})
        report.adopted.append(dep.deployment_id)
    finally:
        dep.life.release()


async def _reject(sup: Supervisor, dep: Deployment, why: str, report: AdoptionReport) -> None:
    """Not proven: torn down (verified), as a launch that failed."""
    from services.supervisor import lifecycle

    sup.adoption_rejections["not_proven"] += 1
    report.failed[dep.deployment_id] = why
    dep.record_error(why)
    sup.incident(dep, EventName.ADOPTION_FAILED, why, {"job_id": dep.job_id})
    try:
        outcome = await lifecycle.teardown(sup, dep, graceful_s=1.0)
    except TeardownError as exc:
        log.error("%s: %s; its teardown failed too: %s", dep.deployment_id, why, exc)
        return
    dep.launch_failed(LaunchError(why), outcome.to_wire())
    sup.set_state(dep, S.FAILED, why)
