"""Test helpers: a real supervisor on port-0 sockets, run in a background thread's event
loop (so tests can inject seams), a real admin client; and the pieces tests use to start
`python -m services.supervisor` as a process. Deadline polling and exit checks are
re-exported from tests/support/polling.py and processes.py."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.home import read_supervisor_record
from common.keys import generate_key_file, load_cluster_key
from services.admin.cli import AdminClient
from services.supervisor.settings import SupervisorSettings
from tests.support.polling import poll_for
from tests.support.processes import process_gone as pid_gone
from tests.support.requests import CLUSTER_KEYS

__all__ = ["FAKE_RANK", "PORTS_0_ENV", "RunningSupervisor", "ensure_key", "fake_settings",
           "pid_gone", "poll_for", "runtime_names", "supervisor_argv"]

FAKE_RANK = f"{sys.executable} -m tests.fakes.fake_rank"


# Settings for `python -m services.supervisor` with its sockets on free ports (it names
# them in runtime/supervisor.json).
PORTS_0_ENV = {"LOCKSTEP_ADMIN_PORT": "0", "LOCKSTEP_EVENTS_PORT": "0",
               "LOCKSTEP_CONTROL_PORT": "0", "LOCKSTEP_REPORT_PORT": "0"}


def supervisor_argv(home: Path, *options: str) -> list[str]:
    """`python -m services.supervisor` on `home`, its sockets on free ports: it prints
    its endpoints as one JSON line on stdout."""
    return [sys.executable, "-m", "services.supervisor", "--home", str(home),
            "--admin-port", "0", "--events-port", "0", "--control-port", "0",
            "--report-port", "0", *options]


def runtime_names(runtime: Path, proc: subprocess.Popen) -> bool:
    """runtime/supervisor.json exists and names `proc`: that supervisor is up. Read with
    the one strict reader every process uses, so a file it refuses fails the test."""
    return runtime.exists() and read_supervisor_record(runtime).pid == proc.pid


def fake_settings(home: Path, **kw: Any) -> SupervisorSettings:
    base = SupervisorSettings(
        home=home, admin_port=0, events_port=0, control_port=0, report_port=0,
        load_timeout=20.0, graceful_timeout=2.0, stop_timeout=2.0, kill_timeout=2.0,
        lease_interval=0.2, lease_ttl=10.0, canary_runs=3, canary_window_s=0.2,
        canary_timeout_s=10.0, abort_all_timeout=5.0, cancel_timeout=5.0,
        rank_command=FAKE_RANK, rank_telemetry_interval_s=0.1)
    return replace(base, **kw)


def ensure_key(home: Path) -> None:
    key = home / "keys" / "cluster.key"
    if not key.exists():
        generate_key_file(key)


class RunningSupervisor:
    """A Supervisor in its own thread + loop; `client` talks to it over the real socket."""

    def __init__(self, settings: SupervisorSettings, **kwargs: Any) -> None:
        from services.supervisor.service import Supervisor

        ensure_key(settings.home)
        self.loop = asyncio.new_event_loop()
        self.sup = Supervisor(settings, **kwargs)
        started = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.sup.start())
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
                started.set()
                return
            started.set()
            self.loop.run_until_complete(self.sup.wait_closed())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(30)
        if self.error:
            raise self.error
        self.key = load_cluster_key(settings.home / "keys" / "cluster.key")
        CLUSTER_KEYS.append(self.key)  # opens the sealed requests key (tests.support.requests)
        self.client = AdminClient(self.sup.sockets.admin_endpoint, self.key)

    def call(self, command: str, timeout: float = 60.0, **args: Any):
        return self.client.call(command, timeout, **args)

    def ask(self, args: Any, timeout: float = 60.0) -> Any:
        """The command whose Args `args` is: its Reply, decoded once (AdminFailed if the
        supervisor refused)."""
        return self.client.ask(args, timeout)

    def ok(self, command: str, timeout: float = 60.0, **args: Any) -> dict:
        reply = self.call(command, timeout, **args)
        assert reply.ok, f"{command} failed: {reply.code} {reply.message}"
        return reply.data

    def close(self, teardown: bool = True) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        if self.thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.sup.close(teardown=teardown), self.loop)
            with contextlib.suppress(Exception):
                fut.result(60)
            self.thread.join(30)
        self.loop.close()
