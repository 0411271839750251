"""Process identity and the termination ladder, against real misbehaving processes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from common.procs import (
    ProcessIdentity,
    identify,
    is_alive,
    signal_group,
    signal_identity,
    snapshot_children,
    terminate_ladder,
    wait_exit,
)
from tests.support.polling import poll_for
from tests.support.processes import process_gone as exit_proven

# A small process whose bad behaviours the tests switch on with argv[1] (comma list):
#   ignore-term  SIGTERM is ignored
#   hold         keep running when stdin closes (otherwise exit: no strays if we crash)
#   spawn-child  start one child "ignore-term,hold" in the same process group
# It prints "ready <child pid or 0>" once set up, then answers each "ping" with "pong".
PROGRAM = r"""
import signal, subprocess, sys, time
modes = sys.argv[1].split(",")
if "ignore-term" in modes:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = 0
if "spawn-child" in modes:
    proc = subprocess.Popen([sys.executable, sys.argv[0], "ignore-term,hold"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdout.readline()  # its SIGTERM handler is in place once it says ready
    child = proc.pid
print("ready", child, flush=True)
for line in sys.stdin:
    print("pong", flush=True)
while "hold" in modes:
    time.sleep(3600)
"""

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("procs") / "fake_proc.py"
    path.write_text(PROGRAM)
    return path


def readline(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line from the process's stdout, or fail after `timeout`."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
            pytest.fail(f"pid {proc.pid}: no line within {timeout}s (got {buf!r})")
        chunk = proc.stdout.read(1)
        if not chunk:
            pytest.fail(f"pid {proc.pid}: stdout closed (got {buf!r})")
        buf += chunk
    return buf.decode().strip()


def ping(proc: subprocess.Popen[bytes]) -> None:
    """A round trip proves the process is alive and was not killed."""
    assert proc.stdin is not None
    proc.stdin.write(b"ping\n")
    proc.stdin.flush()
    assert readline(proc, 10.0) == "pong"


@pytest.fixture
def spawn(program: Path) -> Iterator[Spawn]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(modes: str = "obedient") -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, str(program), modes], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        procs.append(proc)
        proc.child_pid = int(readline(proc, 15.0).split()[1])  # type: ignore[attr-defined]
        return proc

    yield start
    for proc in procs:
        # Unreaped, the session leader's pid (= its pgid) cannot have been reused.
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.timeout(30)
def test_identify_names_a_running_process(spawn: Spawn, program: Path) -> None:
    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    assert ident.cmdline == (sys.executable, str(program), "obedient")
    # Boot-relative: the wall-clock create_time minus the boot time psutil reads now.
    assert abs(ident.start_time - (psutil.Process(proc.pid).create_time() - psutil.boot_time())) < 0.02
    assert is_alive(ident)
    # Lists from a manifest compare equal to tuples.
    assert ProcessIdentity(ident.pid, ident.start_time, list(ident.cmdline)) == ident  # type: ignore[arg-type]
    assert snapshot_children(proc.pid) == [ident]
    for pid in (0, -1, 4_194_305):  # above any pid_max
        assert identify(pid) is None
    assert snapshot_children(4_194_305) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_pgid", [True, False])
def test_obedient_process_ends_on_sigterm(spawn: Spawn, use_pgid: bool) -> None:
    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    outcome = terminate_ladder([ident], [os.getpgid(proc.pid)] if use_pgid else [],
                               term_timeout=10.0, kill_timeout=5.0)
    assert outcome.path == ["sigterm"]
    assert outcome.survivors == [] and outcome.proven
    assert outcome.exited_at[proc.pid] >= outcome.started_at
    assert exit_proven(proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.timeout(30)
def test_sigterm_ignoring_process_needs_sigkill(spawn: Spawn) -> None:
    proc = spawn("ignore-term")
    ident = identify(proc.pid)
    assert ident is not None
    outcome = terminate_ladder([ident], [os.getpgid(proc.pid)], term_timeout=0.5,
                               kill_timeout=10.0)
    assert outcome.path == ["sigterm", "sigkill"]
    assert outcome.survivors == []
    assert exit_proven(proc.pid)  # a zombie until we reap it: counted as exited
    assert not is_alive(ident)
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_pgid", [True, False])
def test_unkillable_survivor_is_reported_after_retry(spawn: Spawn, use_pgid: bool) -> None:
    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    calls: list[tuple[ProcessIdentity | int, int]] = []
    outcome = terminate_ladder([ident], [proc.pid] if use_pgid else [], term_timeout=0.2,
                               kill_timeout=0.2, kill=lambda target, sig: calls.append((target, sig)))
    assert outcome.path == ["sigterm", "sigkill", "sigkill-retry"]
    assert outcome.survivors == [ident] and not outcome.proven
    target = proc.pid if use_pgid else ident
    assert calls == [(target, signal.SIGTERM), (target, signal.SIGKILL), (target, signal.SIGKILL)]
    ping(proc)


@pytest.mark.timeout(30)
def test_identity_with_wrong_start_time_or_cmdline_is_refused(spawn: Spawn) -> None:
    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    wrong_time = ProcessIdentity(ident.pid, ident.start_time + 1.0, ident.cmdline)
    wrong_cmd = ProcessIdentity(ident.pid, ident.start_time, (*ident.cmdline, "x"))
    for wrong in (wrong_time, wrong_cmd):
        assert not is_alive(wrong)
        assert not signal_identity(wrong, signal.SIGKILL)
        assert not signal_group(proc.pid, signal.SIGKILL, members=[wrong])
        # The recorded process is gone (the pid is someone else's): nothing to signal.
        outcome = terminate_ladder([wrong], [proc.pid], term_timeout=0.1, kill_timeout=0.1)
        assert outcome.path == [] and outcome.survivors == []
        ping(proc)
    # Float noise below the clock-tick resolution is still the same process.
    assert is_alive(ProcessIdentity(ident.pid, ident.start_time + 0.004, ident.cmdline))
    assert signal_identity(ident, 0)


@pytest.mark.timeout(30)
def test_zombie_counts_as_exited_and_is_never_signalled(spawn: Spawn) -> None:
    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    proc.kill()  # and do not wait: it stays a zombie until reaped
    poll_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 10.0,
             "the killed child to become a zombie")
    assert identify(proc.pid) is None
    assert not is_alive(ident)
    assert not signal_identity(ident, signal.SIGKILL)
    assert not signal_group(proc.pid, signal.SIGKILL, members=[ident])
    assert wait_exit([ident], 5.0) == []
    calls: list[object] = []
    outcome = terminate_ladder([ident], [proc.pid], kill=lambda t, s: calls.append((t, s)))
    assert outcome.path == [] and outcome.survivors == [] and calls == []
    assert proc.pid in outcome.exited_at
    assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE  # still unreaped
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(30)
def test_reused_pgid_is_never_signalled(spawn: Spawn) -> None:
    a, b = spawn(), spawn()
    ia, ib = identify(a.pid), identify(b.pid)
    assert ia is not None and ib is not None
    stale = ProcessIdentity(ia.pid, ia.start_time - 5.0, ia.cmdline)  # an earlier owner
    assert not signal_group(a.pid, signal.SIGKILL, members=[stale])
    assert not signal_group(a.pid, signal.SIGKILL, members=[ib])  # alive, other group
    assert not signal_group(a.pid, signal.SIGKILL, members=[])
    ping(a)
    ping(b)
    # Our own group is never a target, whatever the members say.
    me = identify(os.getpid())
    assert me is not None
    assert not signal_group(os.getpgrp(), 0, members=[me])
    # The proven group is signalled.
    assert signal_group(a.pid, signal.SIGTERM, members=[stale, ia])
    assert wait_exit([ia], 10.0) == []
    ping(b)


@contextlib.contextmanager
def child_subreaper() -> Iterator[None]:
    """Orphans re-parent to this test process instead of PID 1 (which here never reaps
    them), so the test can reap the grandchild it kills."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) unavailable")
    try:
        yield
    finally:
        libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")
def test_snapshot_then_ladder_ends_the_whole_tree(spawn: Spawn) -> None:
    with child_subreaper():
        parent = spawn("spawn-child")
        child_pid = parent.child_pid  # type: ignore[attr-defined]
        tree = snapshot_children(parent.pid)
        assert [i.pid for i in tree] == [parent.pid, child_pid]
        outcome = terminate_ladder(tree, [os.getpgid(parent.pid)], term_timeout=0.5,
                                   kill_timeout=10.0)
        # The parent obeys SIGTERM; its child ignores it and is found by the group SIGKILL
        # although its parent is gone.
        assert outcome.path == ["sigterm", "sigkill"]
        assert outcome.survivors == []
        assert exit_proven(parent.pid) and exit_proven(child_pid)
        assert parent.wait(timeout=10) == -signal.SIGTERM

        def reaped() -> bool:
            with contextlib.suppress(ChildProcessError):
                return os.waitpid(child_pid, os.WNOHANG)[0] == child_pid
            return True  # not our child after all: nothing to reap

        poll_for(reaped, 10.0, "the orphaned grandchild to be reaped")


@pytest.mark.timeout(10)
def test_wait_and_ladder_honour_deadlines_on_a_fake_clock() -> None:
    me = identify(os.getpid())
    assert me is not None
    now = [0.0]
    naps: list[float] = []

    def sleep(dt: float) -> None:
        naps.append(dt)
        now[0] += dt

    def clock() -> float:
        return now[0]

    assert wait_exit([me], 1.0, clock=clock, sleep=sleep) == [me]
    assert now[0] == pytest.approx(1.0) and max(naps) <= 0.05
    calls: list[object] = []
    now[0] = 0.0
    outcome = terminate_ladder([me], [], term_timeout=10.0, kill_timeout=5.0,
                               kill=lambda t, s: calls.append(s), clock=clock, sleep=sleep)
    assert outcome.path == ["sigterm", "sigkill", "sigkill-retry"]
    assert outcome.survivors == [me]
    assert calls == [signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]
    assert now[0] == pytest.approx(20.0)


@pytest.mark.timeout(30)
@pytest.mark.skipif(sys.platform != "linux", reason="btime and /proc/PID/stat are Linux's")
def test_identity_survives_a_wall_clock_step(spawn: Spawn, program: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A wall-clock step moves the boot time the kernel reports (btime = now - uptime),
    and with it psutil's create_time of every process. The recorded identity must not
    move: otherwise a live rank would read as exited and its manifest be removed."""
    import psutil._pslinux as pslinux

    proc = spawn()
    ident = identify(proc.pid)
    assert ident is not None
    before = psutil.Process(proc.pid).create_time()
    real = pslinux.boot_time
    monkeypatch.setattr(pslinux, "boot_time", lambda: real() + 3600.0)  # clock set 1 h ahead
    assert psutil.Process(proc.pid).create_time() - before > 3599  # psutil's view moved
    assert identify(proc.pid) == ident
    assert is_alive(ident)
