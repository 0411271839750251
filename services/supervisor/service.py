"""The supervisor process: sockets, deployment table, report handling, the lease and
monitor loops, events, and the reap gate. Deploy/stop/replan orchestration lives in
`lifecycle`, cancel broadcasts in `broadcast`, admin commands in `commands/`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import Any

import zmq.asyncio

from common.envelope import BOOT_ID, Message
from common.home import Paths, live_adoption_record, write_supervisor_record
from common.keys import kv_cache_key, load_cluster_key
from common.messages import (
    DEAD_PHASES,
    TORN_DOWN,
    AdminRequest,
    CacheCleared,
    CancelAck,
    Event,
    EventName,
    EventTopic,
    Lease,
    RankReady,
    Telemetry,
)
from common.procs import START_TIME_TOLERANCE, identify
from common.records import SupervisorRecord
from common.schema import to_wire
from services.supervisor import adoption, commands, lifecycle
from services.supervisor.after_failure import teardown_after_failure
from services.supervisor.broadcast import Broadcaster
from services.supervisor.cache_clears import CacheClears
from services.supervisor.deployment import LIVE, Deployment
from services.supervisor.deployment_state import STARTING, DeploymentState
from services.supervisor.epochs import EpochStore
from services.supervisor.errors import AdminError
from services.supervisor.homelock import hold_home_lock
from services.supervisor.hosts import read_hosts_file
from services.supervisor.job_launch import SupervisorIdentity
from services.supervisor.process_launcher import Launcher, LocalLauncher
from services.supervisor.remote import SshLauncher
from services.supervisor.settings import SupervisorSettings
from services.supervisor.sockets import SupervisorSockets
from services.supervisor.teardown import TeardownSeams

log = logging.getLogger("lockstep.supervisor")
VERSION = "0.1.0"
MONITOR_S = 0.25
JOURNAL_LEN = 200


class Supervisor:
    version = VERSION

    def __init__(self, settings: SupervisorSettings, *, launcher: Launcher | None = None,
                 seams: TeardownSeams | None = None, rank_env: dict[str, str] | None = None,
                 reap_fn=None) -> None:
        self.settings = settings
        self.paths = Paths(settings.home)
        self.launcher = launcher or LocalLauncher()
        self.remote_launcher = SshLauncher(
            home=settings.home, ssh_config=settings.ssh_config,
            connect_timeout=settings.ssh_connect_timeout,
            command_timeout=settings.ssh_command_timeout)
        # `--hosts FILE`: the hosts (and its envs, backend) of deploys that name none.
        self.default_hosts = read_hosts_file(settings.hosts) if settings.hosts else None
        self.seams = seams or TeardownSeams()
        self.rank_env = dict(rank_env or {})
        self.reap_fn = reap_fn
        self.deployments: dict[str, Deployment] = {}
        self.last_reap: dict[str, Any] | None = None
        self.last_adoption: dict[str, Any] | None = None  # the pass at start (adoption.py)
        self.adoption_rejections: collections.Counter[str] = collections.Counter()
        # The last events published (state changes, incidents, reaps), as sent: the
        # incidents of `status` (the console, `lockstep admin status`) outlive their deployment.
        self.journal: collections.deque[dict[str, Any]] = collections.deque(maxlen=JOURNAL_LEN)
        self.started_at = time.time()
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._closed = asyncio.Event()
        self.model_lock = asyncio.Lock()  # one build of the default tiny model at a time
        self._reap_lock = asyncio.Lock()

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.paths.ensure()
        self._lock_fd = hold_home_lock(self.paths)  # one supervisor per home
        self.cluster_key = load_cluster_key(self.paths.cluster_key)  # fail closed
        self.epochs = EpochStore(self.paths.state / "cancel_epoch.json")
        self.ctx = zmq.asyncio.Context()
        s = self.settings
        self.sockets = SupervisorSockets(
            self.ctx, self.cluster_key, bind_host=s.bind_host, rank_host=s.rank_host,
            admin_port=s.admin_port, events_port=s.events_port, control_port=s.control_port,
            report_port=s.report_port)
        me = identify(os.getpid())
        self.me = SupervisorIdentity(os.getpid(), me.start_time if me else time.time(), BOOT_ID,
                                     self.sockets.sender, self.sockets.control_endpoint,
                                     self.sockets.report_endpoint,
                                     kv_cache_key(self.cluster_key))
        self.broadcaster = Broadcaster(self.publish_dep, self.epochs)
        self.cache_clears = CacheClears(self.publish_dep)
        self._write_runtime_file()
        self._loops = [asyncio.create_task(c) for c in (
            self.sockets.report_loop(self._on_report), self.sockets.watch_loop(),
            self._lease_loop(), self._monitor_loop())]
        self._note_restart()
        # Adoption first (the launches a dead predecessor left serving), and only then
        # the admin socket: nobody sees a half-adopted deployment (adoption.py).
        self.last_adoption = (await adoption.adopt_all(self)).to_wire()
        self._loops.append(asyncio.create_task(self.sockets.admin_loop(self._on_admin)))
        try:
            await self.reap()
        except AdminError as exc:  # reported in status; launches stay blocked until fixed
            log.error("reap at start is blocking launches: %s", exc.message)
        log.info("supervisor %s: admin %s events %s control %s report %s", os.getpid(),
                 self.sockets.admin_endpoint, self.sockets.events_endpoint,
                 self.sockets.control_endpoint, self.sockets.report_endpoint)

    def _note_restart(self) -> None:
        """An incident when `up` restarted us (its adoption record says it is restarting
        a supervisor): the console and `admin status` show every restart."""
        rec = live_adoption_record(self.paths.adoption_file)
        if rec is None or rec.restarting_until is None:
            return
        why = f"supervisor restarted as pid {self.me.pid}: {rec.reason}"
        log.warning("%s", why)
        self.publish(Event(topic=EventTopic.INCIDENT, name=EventName.SUPERVISOR_RESTARTED,
                           deployment_id="", state=None, reason=why, at=time.time(),
                           data={"pid": self.me.pid, "window_s": rec.window_s}))

    @property
    def runtime_file(self):
        return self.paths.supervisor_file

    def _write_runtime_file(self) -> None:
        write_supervisor_record(self.runtime_file, SupervisorRecord(
            pid=self.me.pid, boot_id=BOOT_ID, start_time=self.me.start_time,
            admin=self.sockets.admin_endpoint, events=self.sockets.events_endpoint,
            control=self.sockets.control_endpoint, report=self.sockets.report_endpoint))

    async def close(self, *, teardown: bool = True) -> None:
        """Stop every deployment (verified), then the loops and sockets."""
        if teardown:
            for dep in self.deployments.values():
                dep.request_abort("supervisor closing")  # ends retries
            for dep_id in list(self.deployments):
                with contextlib.suppress(AdminError):
                    await lifecycle.stop(self, dep_id, force=True)
        for t in [*self._loops, *self._tasks]:
            t.cancel()
        for t in [*self._loops, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.sockets.close()
        self.ctx.term()
        with contextlib.suppress(FileNotFoundError):
            self.runtime_file.unlink()
        os.close(self._lock_fd)
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        # A task's exception is otherwise lost (its holder never awaits it): log it.
        self._tasks.discard(t)
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.error("task %s failed", t.get_coro().__qualname__, exc_info=exc)

    # --- events and state --------------------------------------------------------------

    def emit(self, topic: EventTopic, name: EventName, dep: Deployment, reason: str = "",
             data: dict[str, Any] | None = None) -> None:
        ev = Event(topic=topic, name=name, deployment_id=dep.deployment_id, state=dep.state,
                   reason=reason[:60000], at=time.time(), data=data or {})
        self.publish(ev)

    def publish(self, ev: Event) -> None:
        self.journal.append(to_wire(ev))
        self.sockets.publish_event(ev)

    def set_state(self, dep: Deployment, state: DeploymentState, reason: str = "") -> None:
        """The one way a state changes (the table's edges, deployment_state); an event."""
        was = dep.state
        if not dep.life.transition(state, reason):
            return
        log.info("deployment %s: %s -> %s %s", dep.deployment_id, was, state, reason)
        done = dep.teardown if state in TORN_DOWN else None  # its ladder path, for the console
        self.emit(EventTopic.DEPLOYMENT, EventName.STATE, dep, reason,
                  {"job_id": dep.job_id, **({"teardown": done} if done else {})})

    def incident(self, dep: Deployment, name: EventName, reason: str,
                 data: dict | None = None) -> None:
        log.error("incident %s on %s: %s", name, dep.deployment_id, reason)
        self.emit(EventTopic.INCIDENT, name, dep, reason, data)

    def publish_dep(self, dep: Deployment, body: Any) -> None:
        if dep.control is not None:
            self.sockets.publish_control(dep.deployment_id, dep.control, body)

    # --- reap gate ---------------------------------------------------------------------

    async def reap(self) -> dict[str, Any]:
        """One reap pass (serialised); raises reap_blocked if launches must not start."""
        from services.reaper.reap import reap_orphans
        from services.reaper.remote import SshRemoteReaper

        loop = asyncio.get_running_loop()

        def publish(ev: Event) -> None:
            loop.call_soon_threadsafe(self.publish, ev)

        fn = self.reap_fn or reap_orphans
        remote = SshRemoteReaper(self.paths, ssh_config=self.settings.ssh_config,
                                 connect_timeout=self.settings.ssh_connect_timeout,
                                 command_timeout=self.settings.ssh_command_timeout)
        async with self._reap_lock:
            # A live supervisor tried every orphan at its start (adoption.py): the
            # adoption window `up` records is not for it to wait out.
            report = await asyncio.to_thread(
                fn, self.paths, term_timeout=self.settings.stop_timeout,
                kill_timeout=self.settings.kill_timeout, kill=self.seams.kill, publish=publish,
                **({"remote": remote, "honour_adoption": False} if self.reap_fn is None
                   else {}))
        self.last_reap = report.to_dict()
        if report.blocking:
            raise AdminError("reap_blocked", "launch refused: " + report.blockers(),
                             self.last_reap)
        return self.last_reap

    # --- admin (commands see the supervisor as interfaces.CommandHost) -------------------

    def get(self, deployment_id: str) -> Deployment:
        return lifecycle.get(self, deployment_id)

    async def deploy(self, **kw: Any) -> dict[str, Any]:
        return await lifecycle.deploy(self, **kw)

    async def stop_deployment(self, deployment_id: str, *, force: bool) -> dict[str, Any]:
        return await lifecycle.stop(self, deployment_id, force=force)

    async def replan(self, deployment_id: str, backend: str, sig: str | None,
                     force: bool = False) -> dict[str, Any]:
        return await lifecycle.replan(self, deployment_id, backend, sig, force)

    async def _on_admin(self, ident: bytes, msg: Message) -> None:
        self.spawn(self._answer(ident, msg.body))

    async def _answer(self, ident: bytes, req: AdminRequest) -> None:
        reply = await commands.dispatch(self, req)
        try:
            await self.sockets.reply(ident, reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a reply too large for the client
            log.error("admin reply for %s not sent: %s", req.command, exc)

    # --- report ---------------------------------------------------------------------------

    def _on_report(self, dep: Deployment, msg: Message) -> None:
        body = msg.body
        if getattr(body, "deployment_id", None) != dep.deployment_id:
            return
        rs = dep.ranks.get(body.rank)
        if rs is None or rs.identity is None:
            return
        now = time.time()
        if isinstance(body, RankReady):
            if body.job_id != dep.job_id or body.pid != rs.pid or abs(
                    body.start_time - rs.identity.start_time) > START_TIME_TOLERANCE:
                rs.on_error(f"rank_ready identity mismatch: pid {body.pid} start "
                            f"{body.start_time:.2f} vs manifest pid {rs.pid}")
                log.error("deployment %s rank %d: %s", dep.deployment_id, body.rank, rs.error)
                return
            rs.on_ready(body, now)
        elif isinstance(body, Telemetry):
            if body.pid != rs.pid or body.job_id != dep.job_id:
                return
            rs.on_telemetry(body, now, time.monotonic())
        elif isinstance(body, CancelAck):
            rs.on_ack(body.epoch, now, time.monotonic())
            self.broadcaster.on_ack(dep.deployment_id, body.epoch, body.rank,
                                    {"step_applied": body.step_applied,
                                     "cancelled": list(body.cancelled)})
        elif isinstance(body, CacheCleared):
            rs.seen(now)
            self.cache_clears.on_cleared(dep.deployment_id, body)

    # --- loops ----------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        while True:
            starting = False
            for dep in list(self.deployments.values()):
                if dep.state not in LIVE or dep.control is None:
                    continue
                starting = starting or dep.state in STARTING
                self.publish_dep(dep, Lease(
                    deployment_id=dep.deployment_id, job_id=dep.job_id,
                    lease_seq=dep.next_lease_seq(),
                    ttl_s=self.settings.lease_ttl, cancel_epoch=self.epochs.current))
            # Ranks wait for their first lease before loading: renew fast while starting.
            await asyncio.sleep(min(0.2, self.settings.lease_interval) if starting
                                else self.settings.lease_interval)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            for dep in list(self.deployments.values()):
                try:
                    self._check_ranks(dep)
                except Exception:  # noqa: BLE001
                    log.exception("monitor failed for %s", dep.deployment_id)

    def _check_ranks(self, dep: Deployment) -> None:
        S = DeploymentState
        if dep.state not in (S.CANARY, S.SERVING) or (dep.busy and dep.state != S.CANARY):
            return  # launching/loading: the launch watches its ranks; stopping: teardown does
        lost = []
        for rs in dep.ranks.values():
            code = rs.popen.poll() if rs.popen is not None else None
            gone = code is not None or rs.exited
            if gone or rs.phase in DEAD_PHASES:
                where = f" on {rs.remote.describe()}" if rs.remote is not None else ""
                what = f"exited with code {code}" if code is not None else (
                    f"is gone{where}" if gone else f"reported {rs.phase}{where}")
                lost.append(f"rank {rs.rank} (pid {rs.pid}) {what}"
                            + (f": {rs.error}" if rs.error else ""))
                self.broadcaster.on_rank_dead(dep.deployment_id, rs.rank)
                self.cache_clears.on_rank_dead(dep.deployment_id, rs.rank)
        if not lost or dep.state == S.CANARY:
            return  # during the canary the launch itself reports the failure
        reason = "; ".join(lost)
        self.incident(dep, EventName.RANK_LOST, reason, {"job_id": dep.job_id})
        dep.record_error(reason)
        self.set_state(dep, S.FAILED, reason)
        dep.rank_lost(reason, self.spawn(teardown_after_failure(self, dep, reason)))
