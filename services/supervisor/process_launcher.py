"""Starting one rank process, behind a small interface (`Launcher.start` is all the
supervisor uses): `LocalLauncher` here, local subprocesses; ranks on other hosts are
started over ssh by `remote.SshLauncher`.

Each local rank leads its own session (`start_new_session=True`), so its pid is its
process group id and a group signal reaches anything it spawned. Output goes to
runtime/logs/<job>-rank<r>.log. `Popen` returns only after exec succeeded, so the
identity read right after it is the rank's own (pid, start time, command line).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common import ports
from common.procs import ProcessIdentity, identify
from common.rank_env import rank_environment
from common.rankspec import RankSettings

IDENTITY_SETTLE_S = 2.0
ROOT = Path(__file__).resolve().parents[2]  # the source tree (ranks run `-m services.rank`)

def rank_env(rank_settings: RankSettings, base: Mapping[str, str]) -> dict[str, str]:
    """The rank service's own rules: DESIGN 5.3 defaults (yielding to the operator's
    values), OpenBLAS preload, no TEMP."""
    return dict(rank_environment(rank_settings, base))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports for a rank to bind, outside the ephemeral range
    (common/ports.py: another process may still take one before the rank binds it, but
    no outgoing connection will; if one is taken, the rank fails to load and says so)."""
    return ports.free_ports(n, host)


@dataclass
class Started:
    identity: ProcessIdentity
    pgid: int
    popen: subprocess.Popen | None  # None for remote ranks
    log_path: Path
    remote: bool = False
    ssh: str | None = None


class LaunchFailed(Exception):
    pass


class Launcher(Protocol):
    def start(self, argv: list[str], env: dict[str, str], log_path: Path, *,
              rank: int, host_ssh: str) -> Started: ...


class LocalLauncher:
    """Runs each rank as a local subprocess in its own session."""

    def __init__(self, cwd: Path | None = None) -> None:
        self.cwd = cwd if cwd is not None else (ROOT if (ROOT / "services").is_dir() else None)

    def start(self, argv: list[str], env: dict[str, str], log_path: Path, *,
              rank: int, host_ssh: str) -> Started:
        log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            popen = subprocess.Popen(argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                     stdout=fd, stderr=subprocess.STDOUT,
                                     start_new_session=True, close_fds=True)
        except OSError as exc:
            raise LaunchFailed(f"rank {rank}: cannot start {argv[0]}: {exc}") from None
        finally:
            os.close(fd)
        ident = settled_identity(popen, argv)
        if ident is None:
            code = popen.wait()
            raise LaunchFailed(f"rank {rank} exited at once with code {code}; see {log_path}")
        return Started(ident, popen.pid, popen, log_path)


def settled_identity(popen: subprocess.Popen, argv: list[str],
                     timeout: float = IDENTITY_SETTLE_S) -> ProcessIdentity | None:
    """The child's identity once exec has finished. Popen returns when the exec reached
    its point of no return, which can be before the kernel has set up the new command
    line: /proc/<pid>/cmdline reads empty for a moment. Recording that would make every
    later identity check fail (and the rank look gone), so wait for the real argv."""
    deadline = time.monotonic() + timeout
    ident = None
    while True:
        ident = identify(popen.pid)
        if ident is not None and ident.cmdline == tuple(argv):
            return ident
        if popen.poll() is not None:
            return None
        if time.monotonic() >= deadline:  # an interpreter that rewrites its argv
            return ident if ident is not None and ident.cmdline else None
        time.sleep(0.002)


def log_tail(path: Path | None, limit: int = 1200) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
