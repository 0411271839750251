"""`lockstep up`'s blocking admin link to the supervisor it started (found through
runtime/supervisor.json), and the errors `up` stops on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from common.atomic_json import StateFileError
from common.bus import BusTimeout, Channel, new_request_id
from common.deployment_info import DeploymentInfo
from common.envelope import Key
from common.home import Paths, read_supervisor_record
from common.messages import ADMIN_OUT, AdminRequest, DeploymentState
from common.messages.commands import (
    ReplyError,
    abort_all,
    args_wire,
    command_of,
    deployments,
    ping,
    stop,
)
from common.rpc_client import SyncRpcClient


class UpError(Exception):
    pass


class DeploymentDown(UpError):
    """The deployment left serving on its own (failed, stopped, teardown failed)."""

    def __init__(self, dep_id: str, state: DeploymentState, error: str | None) -> None:
        super().__init__(f"deployment {dep_id} is {state}: {error}")
        self.dep_id, self.state = dep_id, state


class AdminLink:
    """Blocking admin client to the supervisor we started (found via supervisor.json)."""

    def __init__(self, paths: Paths, key: Key, sup_pid: int) -> None:
        self.paths, self.key, self.sup_pid = paths, key, sup_pid
        self.ctx = zmq.Context()
        self.client: SyncRpcClient | None = None
        # While serving, a stop request (Ctrl-C, SIGHUP, SIGTERM) ends any wait for a reply
        # at once; the shutdown clears it, since its own calls are the orderly stop.
        self.interrupted: Callable[[], bool] | None = None

    def close(self) -> None:
        """Drop the connection (a dead supervisor's: its DEALER would otherwise reconnect
        to the restarted one on the same port, and be dropped there mid-handshake)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.ctx.destroy(linger=0)

    def wait_endpoints(self, timeout: float, stop: threading.Event, check) -> tuple[str, str]:
        """Wait until our supervisor wrote supervisor.json and answers ping."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set():
            check()
            try:
                info = read_supervisor_record(self.paths.supervisor_file)
            except StateFileError:  # not written yet (or an old one's, being replaced)
                info = None
            if info is not None and info.pid == self.sup_pid:
                eps = (info.admin, info.events)
                if self.client is None:  # one connection, kept across unanswered pings:
                    # a restarted supervisor answers only after adopting (seconds), and
                    # a connection dropped mid-handshake is a rejection on its side
                    ch = Channel("up", "admin", sender="up", send_key=self.key,
                                 accept=ADMIN_OUT)
                    self.client = SyncRpcClient(self.ctx, eps[0], ch)
                try:
                    self.ask(ping.Args(), timeout=2.0)
                    return eps
                except (UpError, BusTimeout):
                    pass  # a late answer to this ping is dropped (request ids)
            stop.wait(0.2)
        raise UpError("the supervisor did not come up (see its log)" if not stop.is_set()
                      else "interrupted while starting")

    def ask(self, args: Any, timeout: float = 10.0) -> Any:
        """Run the command whose Args `args` is; its Reply, decoded once (UpError if the
        supervisor refused or answered with something else)."""
        if self.client is None:
            raise UpError("no supervisor connection")
        cmd = command_of(args)
        command = cmd.name
        try:
            reply = self.client.call(AdminRequest(request_id=new_request_id(), command=command,
                                                  args=args_wire(args)), timeout,
                                     self.interrupted).body
        except BusTimeout:
            # Lazy Pirate: a timed-out DEALER may get a late reply; start a fresh socket.
            self.client.close()
            self.client = SyncRpcClient(self.ctx, self.client.endpoint, self.client.channel)
            raise
        if not reply.ok:
            raise UpError(f"{command}: {reply.code}: {reply.message}")
        try:
            return cmd.decode(reply.data)
        except ReplyError as exc:
            raise UpError(str(exc)) from None

    def deployments(self, timeout: float) -> list[DeploymentInfo]:
        """Every deployment the supervisor holds, each read strictly."""
        return self.ask(deployments.Args(), timeout=timeout).deployments

    def deployment(self, dep_id: str) -> DeploymentInfo | None:
        try:
            deps = self.deployments(5.0)
        except (UpError, BusTimeout):
            return None
        return next((d for d in deps if d.deployment_id == dep_id), None)

    def abort_and_teardown(self, log, rank_pids: set[int]) -> bool:
        ok = True
        try:
            ev = self.ask(abort_all.Args(timeout_s=15.0), timeout=30.0)
            log(f"abort_all: epoch {ev.epoch}, zero active: {ev.zero_active}, ranks {ev.ranks}")
            deps = self.deployments(10.0)
        except (UpError, BusTimeout) as exc:
            log(f"abort_all failed: {exc}")
            return False
        for d in deps:
            rank_pids |= {r.pid for r in d.ranks if r.pid and not r.remote}  # local pids only
            if d.state == DeploymentState.STOPPED:
                continue
            try:
                out = self.ask(stop.Args(d.deployment_id, force=True), timeout=180.0).outcome
                log(f"deployment {d.deployment_id} torn down "
                    f"({'/'.join(out.path) or 'ok'}, proven {out.proven})")
            except (UpError, BusTimeout) as exc:
                log(f"teardown of {d.deployment_id} NOT verified: {exc}")
                ok = False
        return ok
