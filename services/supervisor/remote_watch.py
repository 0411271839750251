"""What the supervisor knows of its remote ranks between launch and teardown: their
markers and whether their processes still live, read on their hosts over ssh
(`hostagent probe`), never guessed from this machine's process table.

One probe per remote host per round (hosts in parallel); a round every `poll_s` while
the deployment loads, every `poll_s * SERVING_FACTOR` once it serves (telemetry on the
report socket carries the rest). An ssh failure changes nothing that was observed: it
is kept in `RankState.remote_error` and named when the launch times out.
"""

from __future__ import annotations

import asyncio
import logging

from common.messages import ProcState
from common.ssh import SshError
from services.hostagent.client import probe
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.deployment_state import DeploymentState
from services.supervisor.remote import RemoteHost

log = logging.getLogger("lockstep.supervisor")
SERVING_FACTOR = 10
S = DeploymentState
WATCHED_STATES = frozenset({S.LAUNCHING, S.LOADING, S.CANARY, S.SERVING})


def probe_host(host: RemoteHost, ranks: list[RankState], deployment_id: str,
               job_id: str) -> None:
    """One probe of `host`: process states and this launch's markers there."""
    try:
        found = probe(host, [rs.identity for rs in ranks], deployment_id)
    except SshError as exc:
        for rs in ranks:
            rs.on_probe_failed(str(exc))
        log.warning("probe of %s failed: %s", host.describe(), exc)
        return
    markers = {m.rank: m for m in found.rank_markers(host.name)}
    states = found.states()
    for rs in ranks:
        m = markers.get(rs.rank)
        ok = m is not None and m.job_id == job_id and m.pid == rs.pid
        rs.on_probe(states.get(rs.pid, ProcState.UNKNOWN), m if ok else None)


def remote_groups(dep: Deployment) -> dict[tuple[str, str, str], list[RankState]]:
    """Remote ranks that have started, by host."""
    groups: dict[tuple[str, str, str], list[RankState]] = {}
    for rs in dep.ranks.values():
        if rs.remote is not None and rs.identity is not None:
            groups.setdefault(rs.remote.key, []).append(rs)
    return groups


async def probe_all(dep: Deployment) -> None:
    groups = list(remote_groups(dep).values())
    await asyncio.gather(*(asyncio.to_thread(probe_host, ranks[0].remote, ranks,
                                             dep.deployment_id, dep.job_id)
                           for ranks in groups))


async def watch(dep: Deployment, poll_s: float) -> None:
    """Until the deployment leaves the watched states (teardown cancels it first)."""
    while dep.state in WATCHED_STATES:
        await probe_all(dep)
        await asyncio.sleep(poll_s * (SERVING_FACTOR if dep.state == S.SERVING else 1))
