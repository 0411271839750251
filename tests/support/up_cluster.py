"""One way to boot `lockstep up` for a live test: `up_cluster(tmp, UpOptions(...))`, or at
module scope `live = up_fixture(UpOptions(...))`.

It starts `lockstep up` in its own session (free HTTP port, internal sockets on free
ports, the tiny preset unless the options name a model), with an environment free of the
caller's LOCKSTEP_* settings (but the port slice tests/conftest.py hands its children),
waits until it is ready in the way the options say, and yields an `UpCluster` (url, admin
header, home, the process and its output). On leaving, the lifecycle is proven from
outside (`stop="proof"`): Ctrl-C, exit status 0, `up` says every process stopped, and
every process of its tree and every pid the test added to `pids` (ranks it saw, old and
new) gone. A test that ends `up` its own way (SIGKILL, a stop it checks itself) says
`stop="test"`: the helper then only makes sure nothing of it is left running.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil
import pytest

from tests.gwutil import GaveUp
from tests.support.polling import poll_for
from tests.support.ports import free_port
from tests.support.processes import INHERITED, REPO, interrupt, kill_group, process_gone

BANNER = "Press Ctrl-C"

Ready = Literal["banner", "ready", "started"]
Stop = Literal["proof", "test"]


@dataclass(frozen=True)
class UpOptions:
    """What `lockstep up` is started with, and how the helper waits for it and ends it.

    model: a preset, path or repo id; None for up's own default (SmolLM2, no --model).
    tp, pp, replicas, restarts, hosts: up's flags; None leaves a flag out (up's default).
    extra: more of up's flags, as on its command line.
    env: settings for up and everything it starts; a value None removes the name.
    ready: "banner" (up printed its banner), "ready" (GET /ready answers 200), or
      "started" (no wait: the test waits for what it needs).
    stop: "proof" (Ctrl-C on leaving, with proof) or "test" (the test ends up itself).
    """

    model: str | None = "tiny"
    tp: int | None = None
    pp: int | None = None
    replicas: int | None = None
    restarts: int | None = None
    hosts: Path | None = None
    extra: tuple[str, ...] = ()
    env: Mapping[str, str | None] = field(default_factory=dict)
    ready: Ready = "banner"
    ready_s: float = 240.0
    stop: Stop = "proof"
    stop_s: float = 120.0  # for up to exit after Ctrl-C
    gone_s: float = 20.0  # then for every process of it to be gone

    def argv(self, home: Path, port: int) -> list[str]:
        """`lockstep up` serving HTTP on `port`, its internal sockets on free ports."""
        flags = [(name, value) for name, value in (
            ("--model", self.model), ("--tp", self.tp), ("--pp", self.pp),
            ("--replicas", self.replicas), ("--restarts", self.restarts),
            ("--hosts", self.hosts)) if value is not None]
        return [sys.executable, "-m", "services", "up", "--home", str(home),
                "--port", str(port), "--admin-port", "0", "--events-port", "0",
                "--control-port", "0", "--report-port", "0", "--reaper-events-port", "0",
                *(a for name, value in flags for a in (name, str(value))), *self.extra]

    def environ(self) -> dict[str, str]:
        """This environment without the caller's LOCKSTEP_* settings, the repository on
        PYTHONPATH, then `env`."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("LOCKSTEP_") or k in INHERITED}
        env["PYTHONPATH"] = str(REPO)
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env


@dataclass
class UpCluster:
    proc: subprocess.Popen
    home: Path
    out: Path  # up's stdout and stderr
    url: str
    port: int
    hdr: dict[str, str] = field(default_factory=dict)  # the admin bearer token
    pids: set[int] = field(default_factory=set)  # must be gone once up stopped

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def banners(self) -> int:
        """How many times `up` said it serves: once per deployment it brought up."""
        return self.text().count(BANNER)

    def running(self) -> bool:
        """True while `up` runs; GaveUp (with its output's end) once it exited."""
        if self.proc.poll() is not None:
            raise GaveUp(f"lockstep up exited ({self.proc.returncode}): {self.text()[-3000:]}")
        return True

    def deployments(self) -> list[dict]:
        return httpx.get(self.url + "/admin/api/cluster/deployments", headers=self.hdr,
                         timeout=10).json()["deployments"]


def _is_ready(c: UpCluster, ready: Ready) -> bool:
    if ready == "banner":
        return c.running() and c.banners() >= 1
    return c.running() and httpx.get(c.url + "/ready", timeout=5).status_code == 200


def _wait(c: UpCluster, opts: UpOptions) -> None:
    if opts.ready == "started":
        return

    def ready() -> bool:
        try:
            return _is_ready(c, opts.ready)
        except httpx.HTTPError:
            return False  # the gateway is not listening yet

    poll_for(ready, opts.ready_s, f"lockstep up ({opts.ready})", interval=0.1)
    c.hdr = {"Authorization": f"Bearer {(c.home / 'admin.token').read_text().strip()}"}


def _prove_stopped(c: UpCluster, opts: UpOptions) -> None:
    tree = [p.pid for p in psutil.Process(c.proc.pid).children(recursive=True)]
    interrupt(c.proc, opts.stop_s)
    assert c.proc.returncode == 0, c.text()[-3000:]
    assert "every process stopped" in c.text(), c.text()[-3000:]
    poll_for(lambda: all(process_gone(p) for p in [*tree, *c.pids]), opts.gone_s,
             "every process of up and of every deployment gone")


@contextlib.contextmanager
def up_cluster(tmp: Path, opts: UpOptions = UpOptions(), *,  # noqa: B008 - frozen
               home: Path | None = None) -> Iterator[UpCluster]:
    """`up` on `home` (default tmp/home), its output in tmp/up.out; see the docstring."""
    home = home or tmp / "home"
    tmp.mkdir(parents=True, exist_ok=True)
    port, out = free_port(), tmp / "up.out"
    log = open(out, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(opts.argv(home, port), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=opts.environ())
    c = UpCluster(proc, home, out, f"http://127.0.0.1:{port}", port)
    try:
        _wait(c, opts)
        yield c
        if opts.stop == "proof":
            _prove_stopped(c, opts)
    finally:
        interrupt(proc, 30)
        kill_group(proc)  # whatever of its session is left: never leak into the suite
        log.close()


def up_fixture(opts: UpOptions = UpOptions(),  # noqa: B008 - frozen
               scope: Literal["module", "function"] = "module"
               ) -> Callable[..., Iterator[UpCluster]]:
    """A fixture booting `up` with `opts` once per `scope`: `live = up_fixture(...)`."""

    @pytest.fixture(scope=scope)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
        with up_cluster(tmp_path_factory.mktemp("up"), opts) as c:
            yield c

    return fixture


def deploy_tiny_pp_beside(c: UpCluster, home: Path) -> None:
    """The tiny preset deployed again beside `up`'s own, at PP=2, as model `tiny-pp` (a
    copy of up's model directory: another model name), waited for until it serves."""
    import shutil

    from common.home import Paths

    pp_model = home / "pp" / "tiny-pp"
    shutil.copytree(Paths(c.home).models / "tiny", pp_model)
    r = httpx.post(c.url + "/admin/api/cluster/deployments", headers=c.hdr, timeout=300,
                   json={"model_path": str(pp_model), "tp": 1, "pp": 2, "wait": True})
    assert r.status_code == 200, r.text
