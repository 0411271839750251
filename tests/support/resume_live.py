"""What the live resume tests share (tests/e2e/test_resume_live.py,
test_resume_more_live.py): `lockstep up` booted on the tiny preset with a short peer
grace, a fault sent to a rank of the serving deployment, the gateway's resume count."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx

from tests.gwutil import GaveUp, free_port, poll_until
from tests.support.processes import interrupt, up_argv

ROOT = Path(__file__).resolve().parents[2]
NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: streams run to max_tokens
MSG = [{"role": "user", "content": "Count for me, slowly, and keep going."}]


def boot(tmp_path: Path, *extra: str, grace: float = 1) -> dict:
    home, port = tmp_path / "home", free_port()
    out = tmp_path / "up.out"
    env = {**os.environ, "LOCKSTEP_PEER_ABORT_GRACE": str(grace),
           "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "8"}
    log = open(out, "wb")  # noqa: SIM115 - closed by stop
    proc = subprocess.Popen(up_argv(home, port, "--restarts", "6", *extra), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)

    def banner():
        if proc.poll() is not None:
            raise GaveUp(f"lockstep up exited: {out.read_text()[-3000:]}")
        return out.read_text().count("Press Ctrl-C")
    poll_until(banner, 180, "lockstep up's banner", interval=0.1)
    token = (home / "admin.token").read_text().strip()
    return {"proc": proc, "log": log, "out": out, "url": f"http://127.0.0.1:{port}",
            "hdr": {"Authorization": f"Bearer {token}"}, "banner": banner}


def stop(c: dict) -> None:
    interrupt(c["proc"], 90)
    c["log"].close()


def serving(c: dict) -> dict:
    deps = httpx.get(c["url"] + "/admin/api/cluster/deployments", headers=c["hdr"],
                     timeout=10).json()["deployments"]
    return next(d for d in deps if d["state"] == "serving")


def resumes(c: dict) -> float:
    text = httpx.get(c["url"] + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^lockstep_gateway_resumes_total\{[^}]*\} (\S+)$",
                                            text, re.M))


def fault(c: dict, rank: int, sig: int) -> list[int]:
    """Send `sig` to `rank` of the serving deployment; returns its launch's rank pids."""
    dep = serving(c)
    pids = [r["pid"] for r in dep["ranks"]]
    c["faulted"] = dep["deployment_id"]
    os.kill(pids[rank], sig)
    return pids
