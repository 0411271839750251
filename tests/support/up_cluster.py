"""One way to boot `lockstep up` for a live test: `up_cluster(tmp, *args, env=...)`.

It starts `lockstep up` in its own session (free HTTP port, internal sockets on free
ports, the tiny preset unless `--model` is given), waits for its banner, and yields an
`UpCluster` (url, admin header, home, the process and its output). On leaving, the
lifecycle is proven from outside: Ctrl-C, exit status 0, and every process of `up`'s tree
and every pid the test added to `pids` (ranks it saw, old and new) gone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.gwutil import GaveUp, free_port, poll_until
from tests.support.processes import interrupt, process_gone, up_argv

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class UpCluster:
    proc: subprocess.Popen
    home: Path
    out: Path  # up's stdout and stderr
    url: str
    hdr: dict[str, str] = field(default_factory=dict)  # the admin bearer token
    pids: set[int] = field(default_factory=set)  # must be gone once up stopped

    def text(self) -> str:
        return self.out.read_text(errors="replace")


@contextlib.contextmanager
def up_cluster(tmp: Path, *args: str, env: dict[str, str] | None = None,
               ready_s: float = 240.0) -> Iterator[UpCluster]:
    home, port, out = tmp / "home", free_port(), tmp / "up.out"
    log = open(out, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(up_argv(home, port, *args), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    c = UpCluster(proc, home, out, f"http://127.0.0.1:{port}")
    try:
        def banner() -> bool:
            if proc.poll() is not None:
                raise GaveUp(f"lockstep up exited: {c.text()[-3000:]}")
            return "Press Ctrl-C" in c.text()
        poll_until(banner, ready_s, "lockstep up's banner", interval=0.2)
        token = (home / "admin.token").read_text().strip()
        c.hdr = {"Authorization": f"Bearer {token}"}
        yield c
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        interrupt(proc, 120)
        assert proc.returncode == 0, c.text()[-3000:]
        poll_until(lambda: all(process_gone(p) for p in [*tree, *c.pids]), 20,
                   "every process of up and of every deployment gone")
    finally:
        interrupt(proc, 30)
        log.close()
