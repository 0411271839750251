"""The supervisor's four sockets (docs/protocol.md "Sockets"):

  admin   ROUTER on bind_host   cluster key   [id, env] in, [id, env] out
  events  PUB    on bind_host   cluster key   [b"events", env]
  control PUB    on rank_host   launch keys   [b"ctl:" + deployment_id, env]
  report  ROUTER on rank_host   launch keys   [id, env] from ranks

Report frames are routed to their launch by the key id in the envelope prefix, then
verified by that launch's own channel (its own replay window); a frame whose key belongs
to no live launch is counted as `unknown_key` and dropped unread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from common.bus import Channel, configure
from common.envelope import PREFIX, Key, Message, Reason, RejectCounter
from common.messages import ADMIN_IN, EVENTS, Event

log = logging.getLogger("lockstep.supervisor")
EVENTS_TOPIC = b"events"

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
                                     accept=ADMIN_IN)
        self.events_channel = Channel("supervisor", "events", sender=sender,
                                      send_key=cluster_key, accept=EVENTS)
        self.report_rejects = RejectCounter("supervisor", "report")
        self.admin = configure(ctx.socket(zmq.ROUTER))
        self.events = configure(ctx.socket(zmq.PUB))
        self.control = configure(ctx.socket(zmq.PUB))
        self.report = configure(ctx.socket(zmq.ROUTER))
        self.all = (self.admin, self.events, self.control, self.report)
        try:
            self.admin_endpoint = _bind(self.admin, bind_host, admin_port)
            self.events_endpoint = _bind(self.events, bind_host, events_port)
            self.control_endpoint = _bind(self.control, rank_host, control_port)
            self.report_endpoint = _bind(self.report, rank_host, report_port)
        except zmq.ZMQError:
            self.close()
            raise
        self.report_routes: dict[bytes, tuple[Channel, Any]] = {}  # key id -> (channel, route)
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
        self.report_routes[key.key_id] = (channel, route)

    def drop_report_route(self, key: Key) -> None:
        self.report_routes.pop(key.key_id, None)

    def _route_report(self, frames: list[bytes]) -> tuple[Any, Message] | None:
        if len(frames) != 2:
            self.report_rejects.add(Reason.BAD_FRAMES)
            return None
        data = frames[1]
        if len(data) < PREFIX.size:
            self.report_rejects.add(Reason.TOO_SHORT)
            return None
        key_id = PREFIX.unpack_from(data)[2]
        entry = self.report_routes.get(key_id)
        if entry is None:
            self.report_rejects.add(Reason.UNKNOWN_KEY)
            return None
        channel, route = entry
        msg = channel.unpack(data)
        return None if msg is None else (route, msg)

    # --- loops -----------------------------------------------------------------------

    async def admin_loop(self, handle: AdminHandler) -> None:
        while True:
            try:
                frames = await self.admin.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            got = self.admin_channel.unpack_router(frames)
            if got is None:
                continue  # rejected and counted; never answered
            ident, msg = got
            await handle(ident, msg)

    async def report_loop(self, handle: ReportHandler) -> None:
        while True:
            try:
                frames = await self.report.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            got = self._route_report(frames)
            if got is not None:
                try:
                    handle(*got)
                except Exception:  # noqa: BLE001 - one bad report must not stop the loop
                    log.exception("report handler failed")

    def close(self) -> None:
        for s in self.all:
            s.close(0)
