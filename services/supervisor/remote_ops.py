"""The supervisor's steps for deployments with ranks on other hosts (docs/supervisor.md
"Remote hosts"): launching them (endpoints, files and processes over ssh, the watch on
their hosts) and removing their launch files after a proven teardown."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import zmq

from common.ssh import SshError
from services.supervisor import job_launch, remote_watch
from services.supervisor.deployment import Deployment
from services.supervisor.errors import LaunchError
from services.supervisor.process_launcher import LaunchFailed
from services.supervisor.remote import hosts_of

if TYPE_CHECKING:
    from services.supervisor.interfaces import LaunchHost, TeardownHost

log = logging.getLogger("lockstep.supervisor")


async def launch_remote(sup: LaunchHost, dep: Deployment) -> None:
    """Some ranks on other hosts: control/report endpoints they can reach (bound here,
    in the loop's thread), then files and processes over ssh in worker threads (the
    loop keeps publishing leases meanwhile), then the watch on their hosts."""
    s = sup.settings
    dep.placed(hosts_of(dep.plan.members, sup.remote_launcher))
    endpoints: dict[int, tuple[str, str]] = {}
    for m in dep.plan.members:
        if not m.local:
            try:
                endpoints[m.index] = sup.sockets.rank_endpoints_toward(m.ip)
            except (OSError, zmq.ZMQError) as exc:
                raise LaunchError(f"rank {m.index} on {m.host}: no control/report endpoint "
                                  f"it can reach: {exc}", rank=m.index) from None
    try:
        await asyncio.to_thread(job_launch.prepare, dep, sup.paths, sup.me, sup.remote_launcher,
                                rank_endpoints=endpoints)
    except LaunchFailed as exc:
        raise LaunchError(str(exc)) from None
    sup.sockets.add_report_route(dep.keys.report, dep.report, dep)
    try:
        await asyncio.to_thread(job_launch.start_ranks, dep, sup.paths, sup.me, s, sup.launcher,
                                floor=sup.epochs.current, extra_env=sup.rank_env,
                                remote=sup.remote_launcher)
    finally:
        if any(rs.remote is not None for rs in dep.ranks.values()):
            dep.watching_remote(sup.spawn(remote_watch.watch(dep, s.remote_poll_s)))


async def remove_remote_files(sup: TeardownHost, dep: Deployment) -> None:
    """After a proven teardown: the launch secret, job files and markers on each remote
    host. A failure is logged and kept in the outcome (the ranks are gone: a leftover
    file opens nothing running)."""
    def remove(host) -> str | None:
        try:
            sup.remote_launcher.remove_launch_files(host, dep.job_id, dep.deployment_id)
        except SshError as exc:
            log.warning("launch files of %s on %s not removed: %s", dep.job_id,
                        host.describe(), exc)
            return f"{host.describe()}: {exc}"
        return None

    hosts = list(dep.remote_hosts.values())
    errors = [e for e in await asyncio.gather(*(asyncio.to_thread(remove, h) for h in hosts))
              if e]
    dep.remote_files_left(errors)
