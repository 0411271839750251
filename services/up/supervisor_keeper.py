"""`lockstep up` keeps its supervisor: one that dies is restarted, on the same ports, and
adopts the launches it left serving (issue 44; services/supervisor/adoption.py).

    supervisor exited (SIGKILL, a crash)
      → runtime/adoption.json: restarting until now + adopt_window (the reaper waits)
      → a restart allowed by the rate (--supervisor-restarts within --restart-window,
        doubling backoff)? else the gateway and reaper keep running, the ranks end by
        their own watchdog (adopt window, lease), and `up` waits for the rate to allow one
      → the new supervisor, same admin/events/control/report ports (the gateway and every
        rank reconnect by themselves), proves and adopts, then answers admin
      → the record's deadline cleared; `up` watches the same deployment again, or
        redeploys it if it was not adopted (counted against --restarts)

The gateway and reaper are never restarted here: they did not die, and the gateway's
streams to rank 0 never passed through the supervisor.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Protocol

from common.envelope import Key
from common.home import Paths, read_supervisor_record, write_adoption_record
from common.procs import identify
from common.records import AdoptionRecord
from services.up.admin import AdminLink, UpError
from services.up.restart_budget import Exhausted, RestartBudget
from services.up.settings import UpSettings


class Up(Protocol):
    """What the keeper uses of `lockstep up` (services/up/run.py's Up): declared here,
    so this module needs nothing above it."""

    s: UpSettings  # type: ignore[valid-type]
    paths: Paths
    key: Key
    admin: AdminLink | None
    stop_flag: threading.Event

    def log(self, msg: str, *, err: bool = False) -> None: ...

    def check_children(self) -> None: ...

    def check_services(self) -> None: ...

    def start_supervisor(self, ports: dict[str, int]) -> subprocess.Popen: ...

    def restart_budget(self) -> RestartBudget: ...

BACKOFF_MAX_S = 60.0


class SupervisorGone(UpError):
    """The supervisor `up` started exited on its own."""

    def __init__(self, pid: int, status: int | None, tail: str) -> None:
        super().__init__(f"supervisor (pid {pid}) exited with status {status}; its log ends:\n"
                         f"{tail}")
        self.pid, self.status = pid, status

    def short(self) -> str:
        return f"supervisor (pid {self.pid}) exited with status {self.status}"


class SupervisorKeeper:
    def __init__(self, up: Up) -> None:
        s = up.s
        self.up = up
        self.budget = RestartBudget(s.supervisor_restarts, s.restart_window, s.restart_backoff,
                                    BACKOFF_MAX_S)
        self.restarts = 0
        self.ports: dict[str, int] = {}  # the first supervisor's bound ports, kept

    # --- the adoption record (the reaper reads it) ----------------------------------------

    def record(self, restarting_until: float | None = None, reason: str = "") -> None:
        me = identify_me()
        if me is None:
            return
        write_adoption_record(self.up.paths.adoption_file, AdoptionRecord(
            up_pid=me[0], up_start_time=me[1], window_s=self.up.s.adopt_window,
            restarting_until=restarting_until, reason=reason,
            supervisor_restarts=self.up.s.supervisor_restarts,
            restart_window_s=self.up.s.restart_window, restarts=self.restarts))

    def forget(self) -> None:
        self.up.paths.adoption_file.unlink(missing_ok=True)

    def remember_ports(self) -> None:
        """The ports the running supervisor bound (0 in the settings: any free one): a
        restarted one binds the same, where the gateway and the ranks reconnect."""
        rec = read_supervisor_record(self.up.paths.supervisor_file)
        self.ports = {name: int(getattr(rec, name).rsplit(":", 1)[1])
                      for name in ("admin", "events", "control", "report")}

    # --- the restart ----------------------------------------------------------------------

    def restart(self, gone: SupervisorGone) -> bool:
        """A new supervisor, once the rate allows, answering admin. False: `up` was told
        to stop meanwhile."""
        up = self.up
        s = up.s
        self.record(time.time() + s.adopt_window, gone.short())
        up.log(f"{gone}", err=True)
        while True:
            decision = self.budget.decide(time.monotonic())
            if not isinstance(decision, Exhausted):
                break
            why = ("supervisor restarts disabled (--supervisor-restarts 0)"
                   if not s.supervisor_restarts else
                   f"supervisor restarts exhausted: {decision.used} in the last "
                   f"{s.restart_window:g}s (--supervisor-restarts, --restart-window)")
            up.log(f"{why}: not restarting it. The gateway and reaper keep running; the "
                   "ranks end on their own (adopt window, lease); Ctrl-C stops everything",
                   err=True)
            self.record(None, why)  # nobody adopts: the reaper may reap once ranks are gone
            if s.supervisor_restarts == 0:
                return self._idle()
            if up.stop_flag.wait(5.0):
                return False
        if decision.delay_s and up.stop_flag.wait(decision.delay_s):
            return False
        self.budget.record(time.monotonic())
        self.restarts += 1
        self.record(time.time() + s.adopt_window,
                    f"{gone.short()} (restart {self.restarts}, {decision.used} within "
                    f"{s.restart_window:g}s of --supervisor-restarts {s.supervisor_restarts})")
        up.admin.close()  # before the new one binds the same port
        p = up.start_supervisor(self.ports)
        up.admin = AdminLink(up.paths, up.key, p.pid)
        up.admin.interrupted = up.stop_flag.is_set
        # Its admin socket answers once its adoption pass is over (bounded by adopt_timeout)
        up.admin.wait_endpoints(60.0 + s.adopt_window, up.stop_flag, up.check_children)
        self.record(None, f"restarted after: {gone.short()}")
        up.log(f"supervisor restarted (pid {p.pid}, restart {self.restarts}, "
               f"{decision.used} within {s.restart_window:g}s)")
        return not up.stop_flag.is_set()

    def _idle(self) -> bool:
        """Restarts disabled: wait for the operator's stop."""
        while not self.up.stop_flag.wait(1.0):
            self.up.check_services()
        return False


def identify_me() -> tuple[int, float] | None:
    import os

    me = identify(os.getpid())
    return None if me is None else (me.pid, me.start_time)
