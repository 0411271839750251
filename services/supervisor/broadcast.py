"""Cancel broadcasts and abort_all (DESIGN.md 6).

`cancel` allocates the next persisted epoch, publishes CANCEL on the deployment's control
topic and re-sends it until every live rank acked (CANCEL_ACK on report) or was declared
dead (the monitor `forget`s dead ranks) or `cancel_timeout` passed; the reply names the
ranks that acked (with step_applied and cancelled ids) and those missing.

`abort_all` broadcasts scope `all` with one epoch to every targeted deployment, then waits
(bounded) until every rank acked and every rank's telemetry reports zero active requests
*after* the abort: a telemetry report counts as evidence if it carries that epoch as
consumed or arrived after the rank's ack.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.bus import AckCollector, BroadcastResult
from common.messages import Cancel, CancelScope
from services.supervisor.deployment import Deployment, RankState

POLL_S = 0.05


def live_ranks(dep: Deployment) -> list[RankState]:
    out = []
    for rs in dep.ranks.values():
        if rs.popen is not None and rs.popen.poll() is not None:
            continue
        if rs.remote is not None and rs.exited:  # observed over ssh
            continue
        out.append(rs)
    return out


class Broadcaster:
    """Owns the collectors in flight, so report acks and monitor deaths reach them."""

    def __init__(self, publish_control, epochs) -> None:
        self._publish = publish_control  # (deployment, body) -> None
        self.epochs = epochs
        self.collectors: dict[tuple[str, int], AckCollector] = {}

    def on_ack(self, deployment_id: str, epoch: int, rank: int, evidence: dict[str, Any]) -> None:
        coll = self.collectors.get((deployment_id, epoch))
        if coll is not None:
            coll.ack(str(rank), evidence)

    def on_rank_dead(self, deployment_id: str, rank: int) -> None:
        for (dep_id, _), coll in list(self.collectors.items()):
            if dep_id == deployment_id:
                coll.forget(str(rank))

    async def _send(self, dep: Deployment, epoch: int, scope: CancelScope, request_ids: list[str],
                    reason: str, deadline_s: float) -> BroadcastResult:
        body = Cancel(deployment_id=dep.deployment_id, epoch=epoch, scope=scope,
                      request_ids=list(request_ids), reason=reason)
        coll = AckCollector([str(r.rank) for r in live_ranks(dep)],
                            lambda: self._publish(dep, body))
        # A rank that already acked this epoch (a re-send raced us) counts at once.
        for rs in dep.ranks.values():
            if rs.acked_epoch >= epoch:
                coll.ack(str(rs.rank), {"step_applied": rs.step, "cancelled": []})
        key = (dep.deployment_id, epoch)
        self.collectors[key] = coll
        try:
            return await coll.run(deadline_s=deadline_s)
        finally:
            self.collectors.pop(key, None)

    async def cancel(self, dep: Deployment, scope: CancelScope, request_ids: list[str], reason: str,
                     deadline_s: float) -> dict[str, Any]:
        epoch = self.epochs.next()
        res = await self._send(dep, epoch, scope, request_ids, reason, deadline_s)
        all_ranks = {str(r) for r in dep.ranks}
        dead = sorted(all_ranks - set(res.acked) - set(res.missing), key=int)
        return {"epoch": epoch, "acked": res.acked,
                "missing": sorted(set(res.missing) | set(dead), key=int), "dead": dead,
                "sends": res.sends}

    async def abort_all(self, deps: list[Deployment], timeout_s: float,
                        reason: str = "abort_all") -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        epoch = self.epochs.next()
        results = await asyncio.gather(*(self._send(d, epoch, CancelScope.ALL, [], reason, timeout_s)
                                         for d in deps))
        per_dep: dict[str, dict[str, Any]] = {}
        while True:
            zero = True
            for dep in deps:
                ranks = {str(rs.rank): rs.active for rs in dep.ranks.values()}
                ok = {str(rs.rank): zero_evidence(rs, epoch) for rs in dep.ranks.values()}
                per_dep[dep.deployment_id] = {"ranks": ranks, "evidence": ok}
                zero = zero and all(ok.values())
            if zero or time.monotonic() >= end:
                break
            await asyncio.sleep(POLL_S)
        single = len(deps) == 1
        flat_ranks: dict[str, int] = {}
        acked: dict[str, Any] = {}
        missing: list[str] = []
        deployments = {}
        for dep, res in zip(deps, results, strict=True):
            def name(r: str, d: str = dep.deployment_id) -> str:
                return r if single else f"{d}/{r}"

            info = per_dep[dep.deployment_id]
            flat_ranks.update({name(r): a for r, a in info["ranks"].items()})
            acked.update({name(r): ev for r, ev in res.acked.items()})
            missing += [name(r) for r in res.missing]
            deployments[dep.deployment_id] = {
                "zero_active": all(info["evidence"].values()), "ranks": info["ranks"],
                "acked": res.acked, "missing": res.missing}
        return {"epoch": epoch, "zero_active": zero, "ranks": flat_ranks, "acked": acked,
                "missing": missing, "deployments": deployments,
                "waited_s": round(timeout_s - max(0.0, end - time.monotonic()), 3)}


def zero_evidence(rs: RankState, epoch: int) -> bool:
    """Telemetry after the abort shows no active request on this rank, or the rank is
    observed gone (a dead follower of a failed deployment never acks: it runs nothing)."""
    if rs.exited:
        return True
    if rs.active != 0 or rs.telemetry_rx == 0.0:
        return False
    if rs.cancel_epoch >= epoch:
        return True
    return rs.acked_epoch >= epoch and rs.telemetry_rx > rs.acked_at
