"""`lockstep up --hosts FILE` over two netns hosts (TP=2: rank 0 on host A, rank 1 on
host B), seen from outside: its output, its admin API, its HTTP; started with the
short timeouts the partition tests need, and stopped with Ctrl-C and proof."""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.home import Paths
from common.procs import ProcessIdentity, snapshot_children
from tests.netns.hosts import REPO_ROOT, NetnsCluster
from tests.netns.remote_support import hosts_doc
from tests.support.polling import poll_for
from tests.support.ports import free_port
from tests.support.processes import process_gone
from tests.support.up_cluster import UpOptions

A, B = 0, 1
GRACE_S = 2.0  # peer_abort_grace: rank 0's verdict comes well inside an 8 s cut
# rank 0 sleeps this long before each step (test seam): a long request stays in flight
STEP_DELAY = "LOCKSTEP_TEST_STEP_DELAY_S=0.02"
PROMPT = "hello"


@dataclass
class Up:
    proc: subprocess.Popen
    out: Path
    home: Path
    url: str
    ranks: list[ProcessIdentity] = field(default_factory=list)  # of every deployment

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def logs(self) -> str:
        """For a failure message: the end of up's output and of the supervisor's log."""
        sup = self.home / "runtime" / "logs" / "supervisor.log"
        tail = sup.read_text(errors="replace")[-4000:] if sup.exists() else "(no log)"
        return f"{self.text()[-2000:]}\n--- supervisor.log ---\n{tail}"

    def banners(self) -> int:
        return self.text().count("Press Ctrl-C")

    def admin_get(self, path: str) -> dict:
        token = (self.home / "admin.token").read_text().strip()
        r = httpx.get(self.url + "/admin/api/cluster/" + path, timeout=10,
                      headers={"authorization": f"Bearer {token}"})
        r.raise_for_status()
        return r.json()

    def deployments(self) -> list[dict]:
        return self.admin_get("deployments")["deployments"]

    def serving(self) -> dict:
        deps = self.all_serving()
        assert len(deps) == 1, deps
        return deps[0]

    def all_serving(self) -> list[dict]:
        return sorted((d for d in self.deployments() if d["state"] == "serving"),
                      key=lambda d: d["replica"])

    def completion(self, model: str) -> str | None:
        """The greedy completion of PROMPT, or None while it is not served."""
        try:
            r = httpx.post(self.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        except httpx.HTTPError:
            return None
        return r.json()["choices"][0]["text"] if r.status_code == 200 else None


def start(c: NetnsCluster, tmp_path: Path, restarts: int, *, resume_timeout: float,
          hosts: tuple[int, ...] = (A, B), extra: tuple[str, ...] = (),
          env_extra: dict[str, str] | None = None) -> Up:
    """`up --hosts` over `hosts` (rank slots in order); `resume_timeout` 0 ends a cut's
    streams; `extra`: more of up's flags; `env_extra`: more LOCKSTEP_* settings."""
    home = tmp_path / "home"
    doc = hosts_doc(c, list(hosts))
    doc["envs"] = [STEP_DELAY]
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps(doc))
    port = free_port()
    opts = UpOptions(hosts=hosts_file, restarts=restarts, extra=extra, env={
        "LOCKSTEP_RANK_TEST_SEAMS": "1", "LOCKSTEP_SSH_CONNECT_TIMEOUT": "3",
        "LOCKSTEP_PEER_ABORT_GRACE": str(GRACE_S), "LOCKSTEP_REMOTE_POLL_S": "0.3",
        "LOCKSTEP_RESUME_TIMEOUT": f"{resume_timeout:g}", **(env_extra or {})})
    out = tmp_path / "up.out"
    # started here, not by up_cluster's context manager: the partition tests wait for
    # the n-th banner themselves and heal the cut link before the stop below
    with open(out, "wb") as log:
        proc = subprocess.Popen(opts.argv(home, port), cwd=REPO_ROOT, env=opts.environ(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Up(proc, out, home, f"http://127.0.0.1:{port}")


def wait_banner(u: Up, n: int, timeout: float) -> None:
    poll_for(lambda: u.banners() >= n or u.proc.poll() is not None, timeout,
             f"banner {n}", interval=0.5)
    assert u.proc.poll() is None, u.logs()


def stop(u: Up) -> None:
    """Ctrl-C: exit 0, every process of `up` and every rank gone, no manifest left."""
    tree = snapshot_children(u.proc.pid)
    u.proc.send_signal(signal.SIGINT)
    assert u.proc.wait(90) == 0, u.logs()
    poll_for(lambda: all(process_gone(p.pid, p.start_time) for p in tree + u.ranks), 15,
             "every process of lockstep up and every rank")
    assert "every process stopped" in u.text()
    assert not list(Paths(u.home).manifests.glob("*.json"))
