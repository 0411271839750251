"""Nothing outlives `lockstep up` (DESIGN 1), however it went: a closed terminal
(its pty hung up, then SIGHUP: every later write is EIO; or hung up with no SIGHUP for
`up`, as under `ssh -t host make up`, where make, the session leader, takes it), Ctrl-C (twice) with its stdout a pipe nobody reads any more (`up | tee`, tee
gone), and SIGKILL, after which the services notice on their own and stop in order.
Each case on a real `up` (supervisor, reaper, gateway, TP=2 MLX ranks), proven from outside:
every pid of its tree and every rank gone, every port it listened on free, no launch
manifest and no supervisor.json left."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.home import Paths
from common.procs import ProcessIdentity, identify, is_alive, signal_identity, snapshot_children
from tests.gwutil import free_port, poll_until
from tests.support.up_cluster import UpOptions

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = UpOptions()  # tiny, up's default split (TP=2)
# generous: with two test workers the machine may be saturated while ranks stop
STOP_DEADLINE = {"sighup": 90.0, "hangup_only": 90.0, "closed_stdout": 90.0, "sigkill": 60.0}


def _listening_ports(tree: list[ProcessIdentity]) -> set[int]:
    ports = set()
    for ident in tree:
        try:
            conns = psutil.Process(ident.pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Terminal:
    """A pty for up's stdout and stderr, read (and dropped) until it is hung up."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if select.select([self.master], [], [], 0.05)[0]:
                try:
                    os.read(self.master, 65536)
                except OSError:
                    return

    def hang_up(self) -> None:
        """Close the window: with no master left, writes to the tty fail (EIO)."""
        if not self._stop.is_set():
            self._stop.set()
            self._reader.join(5)
            os.close(self.master)


def _running_for(home: Path) -> list[ProcessIdentity]:
    """Every live process on this machine that names `home` on its command line: each
    service and rank of that `up`, including any started after a snapshot was taken."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(str(home) in a for a in p.info["cmdline"] or ()):
            ident = identify(p.pid)
            if ident is not None:
                out.append(ident)
    return out


def _rank_identities(port: int, home: Path) -> list[ProcessIdentity]:
    token = (home / "admin.token").read_text().strip()
    deps = httpx.get(f"http://127.0.0.1:{port}/admin/api/cluster/deployments", timeout=10,
                     headers={"authorization": f"Bearer {token}"}).json()["deployments"]
    pids = [r["pid"] for d in deps for r in d["ranks"]]
    assert len(pids) == 2, deps
    return [i for i in map(identify, pids) if i is not None]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sighup", "hangup_only", "closed_stdout", "sigkill"])
def test_nothing_outlives_up(tmp_path, how):
    home, port = tmp_path / "home", free_port()
    paths = Paths(home)
    err = open(tmp_path / "up.err", "wb")  # noqa: SIM115 - closed in finally
    term = Terminal() if how in ("sighup", "hangup_only") else None
    out = term.slave if term else subprocess.PIPE if how == "closed_stdout" else err
    # booted by hand, not by tests/support/up_cluster.py: its stdout is what is tested
    # (a pty hung up, a pipe closed), and so is its end
    proc = subprocess.Popen(OPTIONS.argv(home, port), cwd=ROOT, stdout=out,
                            stderr=term.slave if term else err, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=OPTIONS.environ())
    if term is not None:
        os.close(term.slave)
    up_log = lambda: (paths.logs / "up.log").read_text(errors="replace")  # noqa: E731
    tree: list[ProcessIdentity] = []
    try:
        poll_until(lambda: "Press Ctrl-C" in up_log(), 180, "the banner in up.log", 0.25)
        ranks = _rank_identities(port, home)
        tree = snapshot_children(proc.pid)
        assert {r.pid for r in ranks} <= {i.pid for i in tree}
        assert len(tree) == 6, tree  # up, supervisor, reaper, gateway, 2 ranks
        ports = _listening_ports(tree)
        assert port in ports and len(ports) >= 6, ports
        assert list(paths.manifests.glob("*.json"))

        if how == "sighup":
            term.hang_up()
            proc.send_signal(signal.SIGHUP)
        elif how == "hangup_only":  # the SIGHUP went to a session leader that kept it (make)
            term.hang_up()
        elif how == "closed_stdout":
            proc.stdout.close()  # the reader is gone: every write of up's now fails (EPIPE)
            proc.send_signal(signal.SIGINT)
            poll_until(lambda: "stopping:" in up_log(), 30, "the stop to begin", 0.02)
            proc.send_signal(signal.SIGINT)  # an impatient second Ctrl-C: the stop goes on
        else:
            proc.send_signal(signal.SIGKILL)
        code = proc.wait(STOP_DEADLINE[how])
        poll_until(lambda: not [i for i in tree if is_alive(i)], STOP_DEADLINE[how],
                   "every process lockstep up started to be gone", 0.1)

        assert code == (-signal.SIGKILL if how == "sigkill" else 0), (code, up_log()[-3000:])
        assert _running_for(home) == []
        assert [p for p in ports if not _port_free(p)] == []
        assert list(paths.manifests.glob("*.json")) == []
        assert not (paths.runtime / "supervisor.json").exists()
        if how != "sigkill":
            assert "every process stopped" in up_log()
            assert "NOT verified" not in up_log() and "NOT proven gone" not in up_log()
            assert b"Traceback" not in (tmp_path / "up.err").read_bytes()
        else:  # nobody stopped them but themselves, in order: a verified teardown
            sup_log = (paths.logs / "supervisor.log").read_text(errors="replace")
            assert "verified teardown" in sup_log, sup_log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for ident in tree + _running_for(home):  # never leak a process into the suite
            signal_identity(ident, signal.SIGKILL)
        err.close()
        if term is not None:
            term.hang_up()


@pytest.mark.timeout(240)
def test_up_sigkilled_while_its_ranks_load_leaves_nothing(tmp_path):
    """SIGKILL as soon as the deployment is launching: the supervisor's stop (on its
    parent-death signal) has to catch ranks that are still starting or loading."""
    home, port = tmp_path / "home", free_port()
    paths = Paths(home)
    with open(tmp_path / "up.out", "wb") as out:
        # by hand: it is killed before it serves, which is what is tested
        proc = subprocess.Popen(OPTIONS.argv(home, port), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=OPTIONS.environ())
    up_log = lambda: (paths.logs / "up.log").read_text(errors="replace")  # noqa: E731
    tree: list[ProcessIdentity] = []
    try:
        poll_until(lambda: "deploying" in up_log(), 180, "the deploy in up.log", 0.02)
        tree = snapshot_children(proc.pid)
        assert len(tree) >= 4, tree  # up, supervisor, reaper, gateway (+ ranks so far)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        # the gateway names no home on its command line: wait on the snapshot too, so
        # "exited" is never raced against "identified"
        killed_at = time.monotonic()
        poll_until(lambda: not _running_for(home) and not [i for i in tree if is_alive(i)],
                   30, "every service and rank of that up to be gone", 0.1)
        print(f"everything gone {time.monotonic() - killed_at:.2f}s after SIGKILL")
        assert "Press Ctrl-C" not in up_log()  # it was killed before serving
        assert _port_free(port)
        assert list(paths.manifests.glob("*.json")) == []
        assert not (paths.runtime / "supervisor.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for ident in tree + _running_for(home):
            signal_identity(ident, signal.SIGKILL)
