"""Removing what one run of the network-namespace hosts (tests/netns/hosts.py) made, and
proving it gone: what was made is recorded as it is made (`Made`), and the teardown,
which never raises (it also runs at interpreter exit), reports what it killed and what it
could not remove."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from common import procs
from tests.netns.iproute import ip, netns_pids

STOP_GRACE_S = 5.0
GONE_DEADLINE_S = 10.0


def _proc_desc(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline()).strip()[:160]}"
    except psutil.Error:
        return str(pid)


@dataclass
class Made:
    """What one run created, recorded as it is created: the teardown removes exactly
    this. Held by the finalizer, never the cluster itself."""

    run_dir: Path | None = None
    bridge: str | None = None
    veths: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    sshds: list[subprocess.Popen[bytes]] = field(default_factory=list)
    closed: bool = False


@dataclass
class TeardownReport:
    killed: list[str] = field(default_factory=list)  # processes left in a namespace
    errors: list[str] = field(default_factory=list)  # what could not be removed
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.errors


def teardown(made: Made) -> TeardownReport:
    """Remove what `made` records. Never raises (it also runs at interpreter exit):
    every failure is in the report."""
    report = TeardownReport()
    if made.closed:
        return report
    made.closed = True
    start = time.monotonic()
    for step in (_stop_sshds, _kill_namespace_processes, _delete_links_and_namespaces,
                 _prove_gone):
        try:
            step(made, report)
        except Exception as e:  # keep going: the next step may still remove something
            report.errors.append(f"{step.__name__}: {type(e).__name__}: {e}")
    report.seconds = time.monotonic() - start
    return report


def _stop_sshds(made: Made, report: TeardownReport) -> None:
    # Polite first (sshd closes its listener), then for sure.
    for proc in made.sshds:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in made.sshds:
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                report.errors.append(f"sshd {proc.pid} survived SIGKILL")


def _kill_namespace_processes(made: Made, report: TeardownReport) -> None:
    # Whatever still runs in one of our namespaces: sshd sessions, what a test left
    # behind. Only processes inside our namespaces are touched (zombies are not listed).
    killed: list[procs.ProcessIdentity] = []
    for ns in made.namespaces:
        for pid in netns_pids(ns):
            ident = procs.identify(pid)
            if ident is not None and procs.signal_identity(ident, signal.SIGKILL):
                report.killed.append(f"{ns}: {pid} {' '.join(ident.cmdline).strip()[:160]}")
                killed.append(ident)
    # A killed orphan may stay a zombie (PID 1 here does not reap): that is exited.
    for ident in procs.wait_exit(killed, STOP_GRACE_S):
        report.errors.append(f"process {_proc_desc(ident.pid)} survived SIGKILL")


def _delete_links_and_namespaces(made: Made, report: TeardownReport) -> None:
    # Deleting a veth removes both ends; then the namespaces, the bridge, the files.
    gone_markers = ("Cannot find device", "No such file")
    commands = ([("link", "del", v) for v in made.veths]
                + [("netns", "del", ns) for ns in made.namespaces]
                + ([("link", "del", made.bridge)] if made.bridge else []))
    for cmd in commands:
        cp = ip(*cmd, check=False)
        if cp.returncode != 0 and not any(m in cp.stderr for m in gone_markers):
            report.errors.append(f"ip {' '.join(cmd)}: {cp.stderr.strip()}")
    if made.run_dir is not None:
        shutil.rmtree(made.run_dir, ignore_errors=True)


def _prove_gone(made: Made, report: TeardownReport) -> None:
    # The kernel removes a namespace and its devices asynchronously: poll.
    deadline = time.monotonic() + GONE_DEADLINE_S
    while True:
        left = leftovers_of(made.bridge, made.veths, made.namespaces, made.run_dir)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    report.errors += [f"still present: {what}" for what in left]


def leftovers_of(bridge: str | None, veths: list[str], namespaces: list[str],
                 run_dir: Path | None) -> list[str]:
    """What of a run still exists: links, namespaces, its run directory, and processes
    (not zombies) whose command line names the run directory (its sshds)."""
    left = []
    links = {e.get("ifname") for e in json.loads(ip("-j", "link", "show").stdout or "[]")}
    left += [f"link {n}" for n in [bridge, *veths] if n and n in links]
    listed = set(ip("netns", "list").stdout.split())
    left += [f"namespace {ns}" for ns in namespaces if ns in listed]
    if run_dir is not None:
        if run_dir.exists():
            left.append(f"directory {run_dir}")
        needle = str(run_dir)
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(needle in a for a in (p.info["cmdline"] or [])):
                left.append(f"process {_proc_desc(p.info['pid'])}")
    return left
