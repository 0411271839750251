"""Admin cache clears in flight (commands/cache_clear.py): CACHE_CLEAR on the deployment's
control topic, re-sent until rank 0's CACHE_CLEARED on report (control PUB may drop), or
the deadline, or rank 0 declared dead. Rank 0 applies each clear id once however many
copies arrive (services/rank/cache_clears.py), so a re-send never clears twice.

Clear ids increase within this supervisor process; the ranks of a launch only ever hear
this one supervisor, and a deployment does not outlive it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from common.bus import AckCollector
from common.messages import AdminCode, CacheClear, CacheCleared
from services.supervisor.deployment import Deployment
from services.supervisor.errors import AdminError

RANK0 = "0"  # the one peer that answers


class CacheClears:
    def __init__(self, publish_control) -> None:
        self._publish = publish_control  # (deployment, body) -> None
        self._ids = itertools.count(1)
        self.collectors: dict[tuple[str, int], AckCollector] = {}

    def on_cleared(self, deployment_id: str, body: CacheCleared) -> None:
        coll = self.collectors.get((deployment_id, body.clear_id))
        if coll is not None:
            coll.ack(RANK0, {"step": body.step})

    def on_rank_dead(self, deployment_id: str, rank: int) -> None:
        if rank == 0:
            for (dep_id, _), coll in list(self.collectors.items()):
                if dep_id == deployment_id:
                    coll.forget(RANK0)

    async def clear(self, dep: Deployment, deadline_s: float) -> dict[str, Any]:
        """{deployment_id, clear_id, step, sends, waited_s}; AdminError `timeout` when
        rank 0 did not answer by the deadline (or died first)."""
        clear_id = next(self._ids)
        body = CacheClear(deployment_id=dep.deployment_id, clear_id=clear_id)
        coll = AckCollector([RANK0], lambda: self._publish(dep, body))
        key = (dep.deployment_id, clear_id)
        self.collectors[key] = coll
        t0 = time.monotonic()
        try:
            res = await coll.run(deadline_s=deadline_s)
        finally:
            self.collectors.pop(key, None)
        waited = round(time.monotonic() - t0, 3)
        if RANK0 not in res.acked:
            raise AdminError(AdminCode.TIMEOUT,
                             f"rank 0 of {dep.deployment_id} did not confirm cache clear "
                             f"{clear_id} within {deadline_s:g}s ({res.sends} sends); its "
                             "caches may still hold entries: retry, or check its telemetry",
                             {"clear_id": clear_id, "sends": res.sends, "waited_s": waited})
        return {"deployment_id": dep.deployment_id, "clear_id": clear_id,
                "step": res.acked[RANK0]["step"], "sends": res.sends, "waited_s": waited}
