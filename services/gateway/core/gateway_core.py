"""The gateway's shared core: the `Gateway` every route reads from `app.state.gw`
(settings, the cluster view, the router, metrics, admission's `pick`) and `names` (does
a request's model name a deployment). Below every API's routes: they import this,
never app.py (which imports them to mount them)."""

from __future__ import annotations

import asyncio
import os
import time

from common.bus import new_request_id
from common.envelope import Key
from common.messages import Generate
from services.gateway.core.auth import KeyTable
from services.gateway.core.cluster_view import Cluster
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.metrics import Metrics
from services.gateway.core.prepare_pool import PreparePool
from services.gateway.core.request_channel import Backend
from services.gateway.core.router import Router
from services.gateway.core.settings import GatewaySettings


class Gateway:
    """Everything a request handler needs, on `app.state.gw`."""

    def __init__(self, settings: GatewaySettings, key: Key) -> None:
        self.settings = settings
        self.keys = KeyTable.parse(settings.api_keys, settings.api_key_weights,
                                   settings.api_key_max_priority)
        self.metrics = Metrics()
        self.cluster = Cluster(settings, key, self.metrics)
        self.metrics.cluster = self.cluster
        self.prepare_pool = PreparePool(settings.prepare_threads)
        self.router = Router(settings.route_imbalance, settings.route_index, self.metrics,
                             settings.route_policy)
        self._probe_lock = asyncio.Lock()

    def pick(self, model: str, n: int = 1) -> list[Backend]:
        """The serving deployments (replicas) of `model` that have room for `n` more
        requests; the router (router.py) chooses among them once the prompt is tokenized."""
        c = self.cluster
        cands = [b for b in c.backends.values() if names(b, model)]
        live = sorted((b for b in cands if not b.lost and not b.draining),
                      key=lambda b: b.deployment_id)
        if live:
            # one model path: replicas of one model share its tokenizer
            live = [b for b in live if b.model_path == live[0].model_path]
            # Continuations of this model's failed requests that wait for a deployment go
            # ahead of new requests (they were admitted once): room is kept for them.
            held = sum(1 for s in c.resuming if names(s.backend, model))
            roomy = [b for b in live if not b.full(n + held)]
            if not roomy:  # 429 before any tokenizing: the cheapest refusal under overload
                min(live, key=lambda b: b.active).check_room(n, held)
            return roomy
        if cands:  # rank 0 lost, seen by the gateway itself (rank_link.py)
            b = cands[0]
            raise ApiError(503, f"model {model!r} is not serving: deployment {b.deployment_id}: "
                           f"{b.lost}; waiting for the supervisor", code="model_not_ready",
                           headers={"retry-after": "5"})
        known = [d for d in c.deployments.values() if d.model == model]
        if known:
            d = known[0]
            why = f": {d.error}" if d.error else ""
            raise ApiError(503, f"model {model!r} is not serving: deployment {d.deployment_id} "
                           f"is {d.state}{why}", code="model_not_ready",
                           headers={"retry-after": "5"})
        # its record gone between a teardown and the redeploy's launch: still the model
        # `up` promised back, not an unknown one (the same answer the whole redeploy)
        if (back := c.coming_back(model)) is not None:
            raise ApiError(503, f"model {model!r} is not serving: {back}",
                           code="model_not_ready", headers={"retry-after": "5"})
        if not c.backends:
            raise ApiError(503, f"no deployment is serving: {self.not_ready_reason()}",
                           code="no_serving_deployment", headers={"retry-after": "5"})
        have = sorted({b.model for b in c.backends.values()})
        raise ApiError(404, f"model {model!r} not found; serving: {', '.join(have)}",
                       param="model", code="model_not_found")

    async def tokenizer(self, b: Backend) -> ModelTokenizer:
        return await self.cluster.tokenizers.get(b.model_path, b.deployment_id)

    def view_is_stale(self) -> str | None:
        """Why the cluster view is too old to vouch for any deployment, or None."""
        age = self.cluster.view_age()
        if age is None or age <= self.settings.ready_view_max_age_s:
            return None
        why = self.cluster.supervisor_error or "no refresh"
        return f"the supervisor's last answer is {age:.0f}s old ({why})"

    def not_ready_reason(self) -> str:
        c = self.cluster
        if c.supervisor_error:
            return c.supervisor_error
        if not c.deployments:
            return "no deployment (deploy one: POST /admin/api/cluster/deployments)"
        return "; ".join(f"deployment {d.deployment_id} is {d.state}"
                         + (f" ({d.error})" if d.error else "")
                         for d in c.deployments.values())

    async def probe(self, b: Backend) -> bool:
        """A one-token greedy generation through rank 0: the canary, refreshed."""
        async with self._probe_lock:
            fresh = self.settings.canary_fresh_s
            if b.last_ok_at and time.time() - b.last_ok_at <= fresh:
                return True
            try:
                tok = await self.tokenizer(b)
                ids = tok.encode("ping") or [0]
                s = await b.generate(Generate(request_id=new_request_id(), prompt=ids, max_tokens=1,
                                              stop_token_ids=[], client="gateway-canary"))
            except Exception:  # noqa: BLE001
                return False
            try:
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline:
                    body = await s.next(deadline - time.monotonic())
                    if body is not None and body.finish_reason:
                        break
            finally:
                s.release("canary_timeout")
            return b.last_ok_at is not None and time.time() - b.last_ok_at <= fresh


def names(b: Backend, model: str) -> bool:
    """A request's `model` names a backend by its id (a directory name, or the repo id of
    a Hugging Face snapshot: common/model_ref.py) or by its model directory's path."""
    if model == b.model:
        return True
    if not b.model_path or not model.startswith(("/", "~")):
        return False
    return os.path.realpath(os.path.expanduser(model)) == os.path.realpath(b.model_path)
