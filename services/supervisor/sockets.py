"""The supervisor's four sockets (docs/protocol.md "Sockets"):

  admin   ROUTER on bind_host   cluster key   [id, env] in, [id, env] out
  events  PUB    on bind_host   cluster key   [b"events", env]
  control PUB    on rank_host   launch keys   [b"ctl:" + deployment_id, env]
  report  ROUTER on rank_host   launch keys   [id, env] from ranks

Report frames are routed to their launch by the key id in the envelope prefix, then
verified by that launch's own channel (its own replay window); a frame whose key belongs
to no live launch is counted as `unknown_key` (`retired_key` for a launch that ended)
and dropped unread. A rank's reports count only after it completed the session
handshake on this socket (services.supervisor.report_gate).

Admission (docs/security.md): admin and report are listening sockets with two size caps
and a small RCVHWM (common.bus.configure_listener); their read loops charge every
rejected or handshake frame to a Budget and sleep when it runs dry, so a flood can
neither spin the event loop (leases, admin) nor grow memory past RCVHWM per connection.
The PUBs accept only small subscription frames.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from common.bus import PUB_MAX_SIZE, Channel, configure_listener
from common.envelope import Key, Message, RejectCounter
from common.frame_budget import Budget
from common.messages import ADMIN_IN, EVENTS, Event
from common.zmtp_watch import ZmtpWatch
from services.supervisor.report_gate import REPORT_MAX, ReportAdmission

log = logging.getLogger("lockstep.supervisor")
EVENTS_TOPIC = b"events"
ADMIN_MAX = 1024 * 1024  # admin requests are small (deploy args with a hosts list at most)

AdminHandler = Callable[[bytes, Message], Awaitable[None]]
ReportHandler = Callable[[Any, Message], None]  # (route, message)


WILDCARDS = frozenset({"0.0.0.0", "*"})


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def source_address(address: str) -> str:
    """This machine's address on the route towards `address` (what the kernel would use
    as the source of a connection there; no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError as exc:
            raise OSError(f"no route from this machine to {address}: {exc}") from None
        return s.getsockname()[0]


def _with_host(endpoint: str, host: str) -> str:
    return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"


def _bind(sock: zmq.Socket, host: str, port: int) -> str:
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


class SupervisorSockets:
    def __init__(self, ctx: zmq.asyncio.Context, cluster_key: Key, *, bind_host: str,
                 rank_host: str, admin_port: int, events_port: int, control_port: int,
                 report_port: int) -> None:
        sender = f"supervisor:{socket.gethostname()}:{os.getpid()}"
        self.sender = sender
        self.admin_channel = Channel("supervisor", "admin", sender=sender, send_key=cluster_key,
                                     accept=ADMIN_IN, max_size=ADMIN_MAX)
        self.events_channel = Channel("supervisor", "events", sender=sender,
                                      send_key=cluster_key, accept=EVENTS)
        self.admin_channel.budget = Budget()
        self.admin = configure_listener(ctx.socket(zmq.ROUTER), max_size=ADMIN_MAX)
        self.events = configure_listener(ctx.socket(zmq.PUB), max_size=PUB_MAX_SIZE)
        self.control = configure_listener(ctx.socket(zmq.PUB), max_size=PUB_MAX_SIZE)
        self.report = configure_listener(ctx.socket(zmq.ROUTER), max_size=REPORT_MAX)
        # A sync view of the report socket, for non-blocking handshake replies from the
        # event loop's thread (the only thread that touches it).
        report_now = zmq.Socket.shadow(self.report.underlying)

        def send_report(ident: bytes, data: bytes) -> None:
            try:
                report_now.send_multipart([ident, data], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("report handshake reply not sent: %s", exc)

        self.admission = ReportAdmission(send_report)
        self.report_rejects = self.admission.rejects
        self.all = (self.admin, self.events, self.control, self.report)
        # Connections libzmq closes before any frame (raw bytes, silence) are counted.
        self.watches = [ZmtpWatch(self.admin, self.admin_channel.rejects),
                        ZmtpWatch(self.report, self.report_rejects),
                        ZmtpWatch(self.control, RejectCounter("supervisor", "control")),
                        ZmtpWatch(self.events, self.events_channel.rejects)]
        try:
            self.admin_endpoint = _bind(self.admin, bind_host, admin_port)
            self.events_endpoint = _bind(self.events, bind_host, events_port)
            self.control_endpoint = _bind(self.control, rank_host, control_port)
            self.report_endpoint = _bind(self.report, rank_host, report_port)
        except zmq.ZMQError:
            self.close()
            raise
        self.rank_host = rank_host
        self.extra_rank_endpoints: dict[str, tuple[str, str]] = {}  # local address -> (ctl, rep)

    # --- endpoints for ranks on other hosts --------------------------------------------

    def rank_endpoints_toward(self, address: str) -> tuple[str, str]:
        """(control, report) endpoints that a rank at `address` can connect to. With
        rank_host loopback, both sockets are also bound (once) on this machine's source
        address towards `address`; with a wildcard rank_host, that address is named
        with the bound ports; otherwise rank_host serves every rank."""
        primary = (self.control_endpoint, self.report_endpoint)
        if not (_is_loopback(self.rank_host) or self.rank_host in WILDCARDS):
            return primary
        local = source_address(address)
        if _is_loopback(local):
            return primary  # a rank on this machine
        if self.rank_host in WILDCARDS:
            return (_with_host(self.control_endpoint, local),
                    _with_host(self.report_endpoint, local))
        if local not in self.extra_rank_endpoints:
            self.extra_rank_endpoints[local] = (_bind(self.control, local, 0),
                                                _bind(self.report, local, 0))
            log.info("control/report also bound on %s for ranks at %s: %s", local, address,
                     self.extra_rank_endpoints[local])
        return self.extra_rank_endpoints[local]

    def bind_rank_endpoints(self, control: str, report: str) -> None:
        """Bind `control` and `report` exactly (a restarted supervisor adopting ranks on
        other hosts: they reconnect to the endpoints their spec names); a no-op for the
        primary pair or a pair bound already. zmq.ZMQError if either cannot be bound."""
        if (control, report) == (self.control_endpoint, self.report_endpoint):
            return
        host = control.rsplit(":", 1)[0].removeprefix("tcp://")
        if self.extra_rank_endpoints.get(host) == (control, report):
            return
        self.control.bind(control)
        self.report.bind(report)
        self.extra_rank_endpoints[host] = (control, report)
        log.info("control/report bound again on %s for adopted ranks: %s", host,
                 (control, report))

    # --- publishing ------------------------------------------------------------------

    def publish_event(self, event: Event) -> None:
        try:
            self.events.send_multipart([EVENTS_TOPIC, self.events_channel.pack(event)],
                                       flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # events are best effort; state is the truth
            log.warning("event %s not published: %s", event.name, exc)

    def publish_control(self, deployment_id: str, channel: Channel, body: Any) -> None:
        topic = b"ctl:" + deployment_id.encode()
        try:
            self.control.send_multipart([topic, channel.pack(body)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("control %s for %s not sent: %s", type(body).__name__, deployment_id, exc)

    async def reply(self, ident: bytes, body: Any) -> None:
        await self.admin.send_multipart([ident, self.admin_channel.pack(body)])

    # --- report routing --------------------------------------------------------------

    def add_report_route(self, key: Key, channel: Channel, route: Any) -> None:
        """Reports signed with `key` belong to `route` (a Deployment), once each rank has
        completed the session handshake."""
        self.admission.add(key, channel, route)

    def drop_report_route(self, key: Key) -> None:
        self.admission.drop(key)

    # --- loops -----------------------------------------------------------------------

    async def admin_loop(self, handle: AdminHandler) -> None:
        n = 0
        while True:
            try:
                frames = await self.admin.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            n += 1
            got = self.admin_channel.unpack_router(frames)
            await _pace(self.admin_channel.budget, n)
            if got is None:
                continue  # rejected and counted; never answered
            ident, msg = got
            await handle(ident, msg)

    async def report_loop(self, handle: ReportHandler) -> None:
        n = 0
        while True:
            try:
                frames = await self.report.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            n += 1
            got = self.admission.admit(frames)
            await _pace(self.admission.budget, n)
            if got is not None:
                try:
                    handle(*got)
                except Exception:  # noqa: BLE001 - one bad report must not stop the loop
                    log.exception("report handler failed")

    async def watch_loop(self) -> None:
        """Feed every listener's monitor events to its ZmtpWatch; tick them when due (memory
        freed by a flood of closed connections goes back to the OS once it settled)."""
        poller = zmq.asyncio.Poller()
        by_monitor = {w.monitor: w for w in self.watches}
        for mon in by_monitor:
            poller.register(mon, zmq.POLLIN)
        due = math.inf
        while True:
            wait = None if due == math.inf else max(0, int((due - time.monotonic()) * 1000) + 1)
            try:
                ready = await poller.poll(wait)
                for mon, _ in ready:
                    by_monitor[mon].on_frames(await mon.recv_multipart())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            now = time.monotonic()
            due = min(w.tick(now) for w in self.watches)

    def close(self) -> None:
        for w in self.watches:
            w.close()
        for s in self.all:
            s.close(0)


async def _pace(budget: Budget, n: int) -> None:
    """Sleep while the socket's budget is dry; yield now and then regardless (awaiting a
    socket that already holds a frame does not give other tasks a turn)."""
    if budget.exhausted():
        await asyncio.sleep(max(0.0, budget.resume_at() - time.monotonic()))
    elif n % 64 == 0:
        await asyncio.sleep(0)
