"""The gateway's view of the cluster: the supervisor's admin socket, its events, and one
`Backend` per serving deployment.

The supervisor is found through settings (admin/events endpoints) or
`$LOCKSTEP_HOME/runtime/supervisor.json`, re-read whenever it changes, so a restarted
supervisor is picked up. Deployments are refreshed on every event, on a detected event
gap, and every `refresh_s` as a backstop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio

from common.atomic_json import StateFileError
from common.bus import BusTimeout, Channel, GapTracker, configure, new_request_id
from common.deployment_info import DeploymentInfo
from common.envelope import Key
from common.home import live_adoption_record, live_redeploy_record, read_supervisor_record
from common.keys import KeyFileError, requests_key_of
from common.messages import (
    ADMIN_OUT,
    EVENTS,
    FAILED_STATES,
    AdminReply,
    AdminRequest,
    DeploymentState,
    Event,
    EventName,
    EventTopic,
)
from common.messages.commands import COMMANDS, ReplyError
from common.messages.commands.status import Reply as StatusReply
from common.rpc_client import AsyncRpcClient
from services.gateway.core.request_channel import Backend
from services.gateway.core.settings import GatewaySettings
from services.gateway.core.tokenizers import Tokenizers

log = logging.getLogger("lockstep.gateway.cluster_view")
SERVING = DeploymentState.SERVING


class SupervisorUnavailable(Exception):
    pass


class AdminTimeout(SupervisorUnavailable):
    """No reply within the deadline: the supervisor may be down, or still working on a
    long command (a deploy, a stop)."""


class Cluster:
    def __init__(self, settings: GatewaySettings, key: Key, metrics: Any = None) -> None:
        self.settings = settings
        self.key = key
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.deployments: dict[str, DeploymentInfo] = {}  # the last status's, by id
        self.backends: dict[str, Backend] = {}
        # streams whose deployment failed, waiting to resume (services/gateway/core/resume.py):
        # still active, and abort-all reaches them
        self.resuming: set = set()
        self.resumed_from: collections.Counter[str] = collections.Counter()  # by failed deployment
        # the last resumes, each {request_id, as, from, to, tokens, cause, at}: where each went
        self.resume_log: collections.deque[dict] = collections.deque(maxlen=256)
        self.shutting_down = False  # set by the server (server.py): nothing resumes any more
        # requests waiting for a redeploy (admit_wait.py); abort-all bumps admit_aborts
        self.admit_waiting = 0
        self.admit_aborts = 0
        self.status: StatusReply | None = None  # the last status reply, decoded once
        self.supervisor_error: str | None = "supervisor not contacted yet"
        self.refreshed_at: float | None = None  # wall clock of the last good refresh
        self.tokenizers = Tokenizers()
        self.gaps = GapTracker()
        self.events_seen = 0
        self.reaper_rejections: list[dict] = []  # the reaper's own counters (its events)
        self._admin: AsyncRpcClient | None = None
        self._endpoints: tuple[str, str] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._file_sig: tuple | None = None

    # --- supervisor discovery -----------------------------------------------------

    def _resolve(self) -> tuple[str, str] | None:
        s = self.settings
        if s.admin_endpoint:
            return s.admin_endpoint, s.events_endpoint or ""
        try:
            info = read_supervisor_record(s.supervisor_file)
        except StateFileError:
            return None
        return info.admin, info.events

    def _connect(self) -> None:
        eps = self._resolve()
        if eps is None:
            self.supervisor_error = f"no supervisor: {self.settings.supervisor_file} not found"
            return
        if eps == self._endpoints and self._admin is not None:
            return
        self._disconnect()
        self._endpoints = eps
        ch = Channel("gateway", "admin", sender="gateway", send_key=self.key, accept=ADMIN_OUT)
        self._admin = AsyncRpcClient(self.ctx, eps[0], ch)
        if eps[1]:
            sub = configure(self.ctx.socket(zmq.SUB))
            sub.setsockopt(zmq.SUBSCRIBE, b"events")
            sub.connect(eps[1])
            if self.settings.reaper_events_endpoint:  # one SUB, two publishers
                sub.connect(self.settings.reaper_events_endpoint)
            self._sub = sub
        log.info("supervisor at %s (events %s)", eps[0], eps[1] or "none")

    def _disconnect(self) -> None:
        if self._admin is not None:
            self._admin.close()
        if self._sub is not None:
            self._sub.close(0)
        self._admin, self._sub, self._endpoints = None, None, None

    async def admin(self, command: str, args: dict | None = None,
                    timeout: float | None = None) -> AdminReply:
        """One admin call with a deadline; SupervisorUnavailable if nobody answers."""
        self._connect()
        if self._admin is None:
            raise SupervisorUnavailable(self.supervisor_error or "no supervisor")
        req = AdminRequest(request_id=new_request_id(), command=command, args=dict(args or {}))
        try:
            msg = await self._admin.call(req, timeout or self.settings.admin_timeout_s)
        except BusTimeout as exc:
            self.supervisor_error = f"supervisor at {self._endpoints[0]} did not answer: {exc}"
            self._disconnect()  # re-resolve next time (the supervisor may have moved)
            raise AdminTimeout(self.supervisor_error) from None
        return msg.body

    # --- deployments ----------------------------------------------------------------

    async def refresh(self) -> None:
        """One `status` call: deployments (DeploymentInfo) plus what /metrics exports."""
        timeout = min(5.0, self.settings.admin_timeout_s)
        reply = await self.admin("status", timeout=timeout)
        if not reply.ok:
            raise SupervisorUnavailable(f"status: {reply.code}: {reply.message}")
        try:  # decoded here, once; every reader keeps the objects
            self.status = COMMANDS["status"].decode(reply.data)
        except ReplyError as exc:
            raise SupervisorUnavailable(str(exc)) from None
        self.deployments = {d.deployment_id: d for d in self.status.deployments}
        self.supervisor_error = None
        self.refreshed_at = time.time()
        self._reconcile()

    def _reconcile(self) -> None:
        for dep_id, b in list(self.backends.items()):
            info = self.deployments.get(dep_id)
            if info is None or info.state != SERVING or info.job_id != b.job_id:
                state = info.state if info else "removed"
                log.info("deployment %s is %s: closing its request channel", dep_id, state)
                # failed: its requests may resume elsewhere; stopped or gone: cancelled
                b.close(f"deployment {dep_id} is {state}", failed=state in FAILED_STATES)
                del self.backends[dep_id]
            elif b.lost and b.link.state.back_since_loss():
                # Lost, then rank 0 answered again and the supervisor still vouches for
                # the same job: a link blip, not a death. A fresh channel serves it again.
                log.info("deployment %s: rank 0 answers again; serving it again", dep_id)
                b.close(f"deployment {dep_id}: {b.lost}")
                del self.backends[dep_id]
        for dep_id, info in self.deployments.items():
            if info.state == SERVING:
                self.tokenizers.want(info.model_path)  # before /ready can be true for it
            if info.state == SERVING and dep_id not in self.backends and info.requests_key_sealed:
                try:
                    self.backends[dep_id] = Backend(
                        self.ctx, info, orphan_grace_s=self.settings.orphan_grace_s,
                        on_abort=self._count_abort, key=requests_key_of(info, self.key),
                        max_inflight=self.settings.inflight_limit,
                        retry_after_s=self.settings.overload_retry_after_s)
                except (ValueError, KeyFileError) as exc:
                    log.warning("deployment %s: bad request channel info: %s", dep_id, exc)

    def _count_abort(self, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.aborts.labels(cause=cause).inc()

    def wake(self) -> None:
        self._wake.set()

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except SupervisorUnavailable as exc:
                self.supervisor_error = str(exc)
            except Exception:  # noqa: BLE001 - keep the loop alive, say why
                log.exception("refresh failed")
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when the
            # wake and a cancel land together, swallowing the cancel (stop() then waited
            # forever: a CI run's gateway thread did not stop)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.refresh_s):
                    await self._wake.wait()
            self._wake.clear()

    async def _events_loop(self) -> None:
        ch = Channel("gateway", "events", sender="gateway", send_key=self.key, accept=EVENTS)
        while True:
            sub = self._sub
            if sub is None:
                await asyncio.sleep(0.5)
                self._connect()
                continue
            try:
                if not await sub.poll(500, zmq.POLLIN):
                    continue
                frames = await sub.recv_multipart()
            except zmq.ZMQError:
                await asyncio.sleep(0.2)  # socket replaced under us
                continue
            msg = ch.unpack_sub(frames, b"events")
            if msg is None:
                continue
            self.events_seen += 1
            if msg.body.topic == EventTopic.REAPER and msg.body.name == EventName.REJECTIONS:
                self.reaper_rejections = _reject_rows(msg.body.data.get("rows"))
            if self.gaps.observe(msg):
                log.info("event gap from %s: refreshing", msg.header.sender)
            self._apply_state_event(msg.body)
            log.debug("event %s %s %s", msg.body.name, msg.body.deployment_id, msg.body.state)
            self.wake()

    def _apply_state_event(self, ev: Event) -> None:
        """A deployment that leaves `serving` stops being served and ready at once: the
        next refresh may not come soon (a supervisor busy with that very failure)."""
        if (ev.topic != EventTopic.DEPLOYMENT or ev.name != EventName.STATE
                or ev.state is None or ev.state == SERVING):
            return
        info = self.deployments.get(ev.deployment_id)
        job = ev.data.get("job_id") if isinstance(ev.data, dict) else None
        if info is None or info.state != SERVING or (job and job != info.job_id):
            return
        log.info("event: deployment %s is %s", ev.deployment_id, ev.state)
        self.deployments[ev.deployment_id] = replace(info, state=ev.state,
                                                     error=ev.reason or info.error)
        self._reconcile()

    def view_age(self, now: float | None = None) -> float | None:
        """Seconds since the supervisor last answered a refresh (None: never)."""
        if self.refreshed_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.refreshed_at)

    async def _reap_loop(self) -> None:
        period = max(0.2, min(1.0, self.settings.orphan_grace_s / 2))
        while True:
            await asyncio.sleep(period)
            for b in list(self.backends.values()):
                b.reap_orphans()

    def start(self) -> None:
        self._connect()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(c) for c in
                       (self._refresh_loop(), self._events_loop(), self._reap_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            while not t.done():  # a cancel a task swallowed is sent again
                await asyncio.wait({t}, timeout=1.0)
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                t.result()
        for b in self.backends.values():
            b.close("gateway shutting down")
        self.backends.clear()
        self.tokenizers.close()
        self._disconnect()
        self.ctx.destroy(linger=0)

    def restarting(self, now: float | None = None) -> str | None:
        """Why the supervisor is being restarted (`up` recorded it in runtime/adoption.json
        beside supervisor.json: services/up/supervisor_keeper.py), or None."""
        rec = live_adoption_record(self.settings.supervisor_file.parent / "adoption.json")
        now = time.time() if now is None else now
        if rec is None or rec.restarting_until is None or rec.restarting_until <= now:
            return None
        return rec.reason or "the supervisor died"

    def coming_back(self, model: str) -> str | None:
        """Why `model` is expected to serve again soon (a live `lockstep up` redeploys it
        when it fails: runtime/redeploy.json, services/up/redeploy_notice.py), or None."""
        rec = live_redeploy_record(self.settings.supervisor_file.parent / "redeploy.json")
        if rec is None or rec.model != model:
            return None
        return f"lockstep up (pid {rec.up_pid}) redeploys it" + (
            f" after: {rec.reason}" if rec.reason else "")

    # --- lookups ---------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(b.active for b in self.backends.values()) + len(self.resuming)

    def serving(self) -> list[DeploymentInfo]:
        return [d for d in self.deployments.values() if d.state == SERVING]

    def models(self) -> list[DeploymentInfo]:
        return [d for d in self.serving() if d.deployment_id in self.backends
                and not self.backends[d.deployment_id].lost]

    def canary_at(self, dep: DeploymentInfo) -> float | None:
        """Last proof that the deployment generates: the supervisor's canary or ours."""
        times = [dep.canary_at] if dep.canary_at is not None else []
        b = self.backends.get(dep.deployment_id)
        if b is not None and b.last_ok_at:
            times.append(b.last_ok_at)
        return max(times) if times else None


def _reject_rows(rows: object) -> list[dict]:
    """[{service, socket, reason, count}] from an event, keeping only well-formed rows."""
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict)
            and all(isinstance(r.get(k), str) for k in ("service", "socket", "reason"))
            and type(r.get("count")) is int]
