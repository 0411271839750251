"""Watch the process that started this one (`lockstep up`) and stop when it is gone.

DESIGN 1, "Nothing outlives its launcher". `lockstep up` puts its own identity
(pid + start time) in `LOCKSTEP_LAUNCHER` for each service it starts; the service calls
`watch_launcher` once, from its main thread, after its SIGTERM path is in place. Two
watchers, because neither is enough alone:

  parent death  Linux `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel signals us the
                moment our parent dies, however it died (SIGKILL included). It fires on
                the death of the parent *thread* that forked us (up forks from its main
                thread) and is a per-thread setting of ours (so: our main thread); a
                parent that died before the prctl is caught by checking getppid() right
                after it.
  lease         every `interval_s` the launcher's identity (pid, start time, cmdline:
                common.procs) is checked, and getppid() against the parent we had: works
                where there is no prctl (macOS) and when the launcher is not our parent.
                A lease held by identity, not by heartbeats: a launcher that is only
                stopped (Ctrl-Z) still owns its services.

Either way the verdict is the same: SIGTERM to ourselves, i.e. the service's own orderly
stop (the supervisor's is a verified teardown of every deployment), re-sent every
`resend_s` (a signal that landed before the service's handler was in place is lost), and
after `hard_exit_s` a hard exit: a stop that hangs must not keep the process alive
forever (its ranks watch it in turn). The decisions (`LauncherLease`) take `now`.
The variable is removed from our environment once read, so nothing we start inherits it.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from common.config import ConfigError
from common.procs import START_TIME_TOLERANCE, ProcessIdentity, identify, is_alive

LAUNCHER_ENV = "LOCKSTEP_LAUNCHER"
EXIT_LAUNCHER_GONE = 1
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("lockstep.launcher")


class LauncherWatchError(ConfigError):
    """LOCKSTEP_LAUNCHER is malformed."""


def launcher_value(identity: ProcessIdentity) -> str:
    """What the launcher puts in LOCKSTEP_LAUNCHER for its children."""
    return f"{identity.pid}:{identity.start_time!r}"


def parse_launcher(raw: str) -> tuple[int, float]:
    pid, sep, start = raw.strip().partition(":")
    try:
        if sep and int(pid) > 1:
            return int(pid), float(start)
    except ValueError:
        pass
    raise LauncherWatchError(f"{LAUNCHER_ENV}={raw!r}: expected PID:START_TIME")


@dataclass(frozen=True)
class WatchSettings:
    interval_s: float = 0.5  # between lease checks
    resend_s: float = 5.0  # SIGTERM again while we are still here
    hard_exit_s: float = 120.0  # > a supervisor's verified teardown (25 s per deployment)


class Action(enum.Enum):
    STOP = "stop"  # first verdict: SIGTERM to ourselves
    RESEND = "resend"  # still here: SIGTERM again
    HARD_EXIT = "hard_exit"  # the orderly stop did not end us in time


class LauncherLease:
    """Pure decisions: once the launcher is seen gone it stays gone (a pid + start time
    never comes back), and the stop escalates with `now`."""

    def __init__(self, s: WatchSettings) -> None:
        self.s = s
        self.lost_at: float | None = None
        self.sent_at = 0.0
        self.reason: str | None = None

    def check(self, now: float, gone: str | None) -> Action | None:
        """`gone`: why the launcher is gone on this observation, or None while it lives."""
        if self.lost_at is None:
            if gone is None:
                return None
            self.lost_at = self.sent_at = now
            self.reason = gone
            return Action.STOP
        if now - self.lost_at >= self.s.hard_exit_s:
            return Action.HARD_EXIT
        if now - self.sent_at >= self.s.resend_s:
            self.sent_at = now
            return Action.RESEND
        return None

    def wait(self, now: float) -> float:
        """Seconds until the next check is due."""
        if self.lost_at is None:
            return self.s.interval_s
        return max(0.0, min(self.s.interval_s, self.lost_at + self.s.hard_exit_s - now))


def launcher_gone(launcher: ProcessIdentity, parent_pid: int | None, *,
                  getppid: Callable[[], int] = os.getppid,
                  alive: Callable[[ProcessIdentity], bool] = is_alive) -> str | None:
    """Why the launcher is gone (we were re-parented, or its identity no longer runs)."""
    if parent_pid is not None and (now := getppid()) != parent_pid:
        return f"the launcher (pid {launcher.pid}) is gone: re-parented to pid {now}"
    if not alive(launcher):
        return f"the launcher (pid {launcher.pid}) has exited"
    return None


def set_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send `sig` when our parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


class LauncherWatch:
    """The lease on a thread of its own; `stop` and `hard_exit` are injected."""

    def __init__(self, service: str, launcher: ProcessIdentity, parent_pid: int | None, *,
                 settings: WatchSettings = WatchSettings(),
                 stop: Callable[[], None] | None = None,
                 hard_exit: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 gone: Callable[[], str | None] | None = None) -> None:
        self.service, self.launcher, self.parent_pid = service, launcher, parent_pid
        self.lease = LauncherLease(settings)
        self.stop = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.hard_exit = hard_exit or (lambda: os._exit(EXIT_LAUNCHER_GONE))
        self.clock = clock
        self.gone = gone or (lambda: launcher_gone(self.launcher, self.parent_pid))
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> float:
        """One check; returns the seconds until the next."""
        now = self.clock()
        action = self.lease.check(now, None if self.lease.lost_at is not None else self.gone())
        if action is Action.STOP:
            log.warning("%s: %s; stopping in order", self.service, self.lease.reason)
            self.stop()
        elif action is Action.RESEND:
            self.stop()
        elif action is Action.HARD_EXIT:
            log.error("%s: still running %.0fs after its launcher left; exiting hard",
                      self.service, now - (self.lease.lost_at or now))
            with contextlib.suppress(Exception):
                logging.shutdown()
            self.hard_exit()
        return self.lease.wait(now)

    def start(self) -> LauncherWatch:
        self._thread = threading.Thread(target=self._run, name="launcher-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._wake.wait(self.tick()):
            pass

    def close(self) -> None:
        self._wake.set()


def watch_launcher(service: str, environ: MutableMapping[str, str] | None = None, *,
                   settings: WatchSettings = WatchSettings()) -> LauncherWatch | None:
    """Start watching the launcher named in LOCKSTEP_LAUNCHER (None: started by hand,
    nothing to watch). Call from the main thread, once the SIGTERM path is in place."""
    env = os.environ if environ is None else environ
    raw = env.pop(LAUNCHER_ENV, None)
    if not raw:
        return None
    pid, start = parse_launcher(raw)
    parent = pid if os.getppid() == pid else None
    if parent is not None and threading.current_thread() is threading.main_thread():
        set_parent_death_signal(signal.SIGTERM)
    ident = identify(pid)
    if ident is None or abs(ident.start_time - start) > START_TIME_TOLERANCE:
        # already gone (or the pid reused): an identity nothing running matches
        ident = ProcessIdentity(pid, start, ("<gone>",))
    watch = LauncherWatch(service, ident, parent, settings=settings)
    watch.tick()  # a launcher that died before the prctl: caught here, at once
    log.info("%s: watching its launcher, pid %d", service, pid)
    return watch.start()
