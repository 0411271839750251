"""Process identity (pid + start time + command line) and signalling with proof.

A pid alone names nothing: it is reused. Every signal here goes only to a process whose
recorded identity still matches, and every "it exited" is observed, not assumed.

The start time is read so that a wall-clock step cannot change it: on Linux it is the
kernel's own start tick (seconds since the host booted, from /proc/PID/stat), not
psutil's create_time, which adds the boot time as the wall clock sees it *now* and so
moves with every NTP step or manual `date -s`. Every reader (supervisor, reaper, rank,
host agent) is on the same host as the process it names, so they all agree.

A zombie counts as exited (it holds no memory) and is never signalled: on these machines
PID 1 does not promptly reap orphans, so a killed orphan can stay a zombie for a while.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import psutil

# Start times have clock-tick resolution (1/100 s on Linux).
START_TIME_TOLERANCE = 0.01
_PROC_STAT = "/proc/{pid}/stat"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
POLL_INTERVAL = 0.025
_EXITED = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)

Clock = Callable[[], float]
Sleep = Callable[[float], None]


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: float  # see start_time_of: boot-relative on Linux
    cmdline: tuple[str, ...]

    def __post_init__(self) -> None:
        # Records on disk carry lists; equality must not depend on that.
        object.__setattr__(self, "cmdline", tuple(self.cmdline))


# Test seam: called instead of the real kill, only after the identity checks passed.
# Receives a ProcessIdentity for a single process, or an int pgid for a group.
Kill = Callable[[ProcessIdentity | int, int], None]


def _boot_relative_start(pid: int) -> float | None:
    """Seconds from host boot to the process's start (Linux), or None elsewhere."""
    try:
        with open(_PROC_STAT.format(pid=pid), "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(pid) from None
        return None
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    # starttime is field 22, i.e. the 20th after comm.
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19]) / _CLOCK_TICKS


def start_time_of(proc: psutil.Process) -> float:
    """The start time identities record: boot-relative on Linux (immune to wall-clock
    steps), psutil's create_time where there is no /proc (macOS)."""
    rel = _boot_relative_start(proc.pid)
    return proc.create_time() if rel is None else rel


def _identity_of(proc: psutil.Process) -> ProcessIdentity | None:
    try:
        with proc.oneshot():
            if proc.status() in _EXITED:
                return None
            return ProcessIdentity(proc.pid, start_time_of(proc), tuple(proc.cmdline()))
    except _GONE:
        return None


def identify(pid: int) -> ProcessIdentity | None:
    """The identity of a running process; None if it is gone, a zombie, or unreadable."""
    if pid <= 0:
        return None
    try:
        return _identity_of(psutil.Process(pid))
    except _GONE:
        return None


def _matching(identity: ProcessIdentity) -> psutil.Process | None:
    """The running process that `identity` names, or None: exited, a zombie, or the pid
    now belongs to another process (other start time or cmdline, or not ours to read)."""
    if identity.pid <= 0:  # kill(0) and kill(-1) address groups, never one process
        return None
    try:
        proc = psutil.Process(identity.pid)
    except _GONE:
        return None
    current = _identity_of(proc)
    if current is None:
        return None
    if abs(current.start_time - identity.start_time) > START_TIME_TOLERANCE:
        return None
    # A process on its way out has released its memory, argv with it, and reads as an
    # empty cmdline until it is a zombie: it has not exited yet, the start time decides.
    if current.cmdline and current.cmdline != identity.cmdline:
        return None
    return proc


def is_alive(identity: ProcessIdentity) -> bool:
    """The pid exists, is not a zombie (a zombie has exited: it holds no memory), and has
    the recorded start time and cmdline (or, while it is exiting, an empty one)."""
    return _matching(identity) is not None


def _signal_identity(identity: ProcessIdentity, sig: int, kill: Kill | None) -> bool:
    proc = _matching(identity)
    if proc is None:
        return False
    try:
        if kill is not None:
            kill(identity, sig)
        else:
            # psutil re-checks pid + create time on this same object right before kill().
            proc.send_signal(sig)
    except _GONE:
        return False
    return True


def signal_identity(identity: ProcessIdentity, sig: int) -> bool:
    """Send `sig` only if `identity` still names a running process; True if sent."""
    return _signal_identity(identity, sig, None)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_proven(pgid: int, members: Iterable[ProcessIdentity]) -> bool:
    # A pgid stays taken while any member lives, so one live recorded member that is
    # still in the group proves the group is ours and not a reused number.
    return any(is_alive(m) and _pgid(m.pid) == pgid for m in members)


def _signal_group(pgid: int, sig: int, members: Iterable[ProcessIdentity],
                  kill: Kill | None) -> bool:
    # pgid 0/1 would be our own group or init's; our own group would take us down too.
    if pgid <= 1 or pgid == os.getpgrp() or not _group_proven(pgid, members):
        return False
    try:
        if kill is not None:
            kill(pgid, sig)
        else:
            os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def signal_group(pgid: int, sig: int, *, members: list[ProcessIdentity]) -> bool:
    """Signal process group `pgid` only if a recorded member still matches and is in it."""
    return _signal_group(pgid, sig, members, None)


def _wait(identities: Iterable[ProcessIdentity], timeout: float, clock: Clock, sleep: Sleep,
          exited_at: dict[int, float]) -> list[ProcessIdentity]:
    deadline = clock() + timeout
    pending = list(identities)
    while True:
        still = []
        for ident in pending:
            if is_alive(ident):
                still.append(ident)
            else:
                exited_at.setdefault(ident.pid, clock())
        pending = still
        remaining = deadline - clock()
        if not pending or remaining <= 0:
            return pending
        sleep(min(POLL_INTERVAL, remaining))


def wait_exit(identities: Iterable[ProcessIdentity], timeout: float, *,
              clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> list[ProcessIdentity]:
    """Poll until every identity has exited or `timeout` passed; returns the survivors."""
    return _wait(identities, timeout, clock, sleep, {})


@dataclass
class LadderOutcome:
    survivors: list[ProcessIdentity]
    # Steps taken: [] (nothing was alive), ["sigterm"], ["sigterm", "sigkill"] or
    # ["sigterm", "sigkill", "sigkill-retry"]. The last step is the one that ended it,
    # unless there are survivors.
    path: list[str] = field(default_factory=list)
    exited_at: dict[int, float] = field(default_factory=dict)  # pid -> clock() when seen
    started_at: float = 0.0  # clock() at the start, to turn exited_at into durations

    @property
    def proven(self) -> bool:
        return not self.survivors


_STEPS = (("sigterm", signal.SIGTERM), ("sigkill", signal.SIGKILL),
          ("sigkill-retry", signal.SIGKILL))


def _signal_all(targets: list[ProcessIdentity], pgids: Sequence[int], sig: int,
                kill: Kill | None) -> None:
    groups = {t.pid: _pgid(t.pid) for t in targets}  # before signalling: they may exit
    covered: set[int] = set()
    for pgid in pgids:
        if _signal_group(pgid, sig, targets, kill):
            covered.update(pid for pid, g in groups.items() if g == pgid)
    for ident in targets:
        if ident.pid not in covered:  # not reached by a group signal: signal it alone
            _signal_identity(ident, sig, kill)


def terminate_ladder(identities: Iterable[ProcessIdentity], pgids: Iterable[int] = (), *,
                     term_timeout: float = 10.0, kill_timeout: float = 5.0,
                     kill: Kill | None = None, clock: Clock = time.monotonic,
                     sleep: Sleep = time.sleep) -> LadderOutcome:
    """SIGTERM → wait → SIGKILL → wait → SIGKILL → wait, stopping as soon as every
    identity has exited. Each step signals every group in `pgids` that still holds a
    live recorded identity, and each live identity not reached that way on its own."""
    targets = list(dict.fromkeys(identities))
    groups = sorted(set(pgids))
    start = clock()
    outcome = LadderOutcome(survivors=[], started_at=start)
    outcome.survivors = _wait(targets, 0.0, clock, sleep, outcome.exited_at)
    timeouts = (term_timeout, kill_timeout, kill_timeout)
    for (step, sig), timeout in zip(_STEPS, timeouts, strict=True):
        if not outcome.survivors:
            break
        outcome.path.append(step)
        _signal_all(outcome.survivors, groups, sig, kill)
        outcome.survivors = _wait(outcome.survivors, timeout, clock, sleep, outcome.exited_at)
    return outcome


def snapshot_children(pid: int) -> list[ProcessIdentity]:
    """Identities of the process `pid` and all its descendants (root first). Take it
    before killing a tree: once a parent dies, its children are re-parented and can no
    longer be found from it."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except _GONE:
        return []
    return [i for i in (_identity_of(p) for p in procs) if i is not None]
