"""Where the launch secret is not (DESIGN.md §3, issue 9): over a live `lockstep up`
(supervisor, reaper and gateway as separate processes, TP=2 real MLX ranks), grep for the
launch secret and every key derived from it (and the cluster key), raw and hex, in:
every /proc/*/cmdline; the environment of every Lockstep process; every log line; the
output of `lockstep admin status` / `deployments` (plain and --json); the gateway's
admin status and /metrics; every file under $LOCKSTEP_HOME except the 0600 secret file
itself (and the 0600 cluster key file for the cluster key). It runs on the shared cluster
(tests/support/live_cluster.py: TP=2 and PP=2 deployments, so two launch secrets), whose
verified teardown on Ctrl-C, after its last test, proves every secret file gone and no
file under its home holding a launch secret."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from common.atomic_json import read_json
from common.keys import CHANNELS, LaunchKeys, load_cluster_key, read_secret_file
from tests.support.processes import REPO


def needles(secret: bytes, dep: str, job: str, cluster: bytes) -> dict[str, bytes]:
    lk = LaunchKeys(secret, dep, job)
    keys = {"launch secret": secret, "cluster key": cluster}
    keys |= {f"{ch} key": getattr(lk, ch).secret for ch in CHANNELS}
    keys |= {f"session {r}/{d}": lk.session(r, d).secret for r in (0, 1) for d in ("up", "down")}
    out = {}
    for name, raw in keys.items():
        out[name] = raw
        out[name + " (hex)"] = raw.hex().encode()
        out[name + " (HEX)"] = raw.hex().upper().encode()
    return out


def leaks(blob: bytes, ns: dict[str, bytes]) -> list[str]:
    return [name for name, n in ns.items() if n in blob]


def lockstep(home: Path, *args: str) -> bytes:
    r = subprocess.run([sys.executable, "-m", "services", "admin", "--home", str(home),
                        *args], cwd=REPO, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r.stdout + r.stderr


@pytest.mark.timeout(420)
def test_launch_secret_is_nowhere_but_its_0600_file(live_cluster):
    home, url, proc = live_cluster.home, live_cluster.url, live_cluster.proc
    out_path = live_cluster.out
    cluster = load_cluster_key(home / "keys" / "cluster.key").secret
    manifests = [read_json(p) for p in (home / "runtime" / "manifests").glob("*.json")]
    assert len(manifests) == len(live_cluster.deps) == 2
    ns: dict[str, bytes] = {}
    secret_paths = []
    for man in manifests:
        secret_path = Path(man["secret_path"])
        secret = read_secret_file(secret_path)  # also proves it is a 0600 regular file
        mine = needles(secret, man["deployment_id"], man["job_id"], cluster)
        assert leaks(secret_path.read_bytes(), mine) == ["launch secret (hex)"]  # they work
        secret_paths.append(secret_path)
        ns |= {f"{man['deployment_id']}: {name}": n for name, n in mine.items()}
    # Some traffic first, and a rejection, so logs and counters have something in them.
    hdr = {"authorization": "Bearer " + (home / "admin.token").read_text().strip()}
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text

    found: dict[str, list[str]] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            blob = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if hits := leaks(blob, ns):
            found[f"/proc/{p.pid}/cmdline"] = hits
    ours = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    ours += [rk["pid"] for man in manifests for rk in man["ranks"]]
    assert len(set(ours)) >= 8  # up, supervisor, reaper, gateway, 2 x 2 ranks
    for pid in set(ours):
        try:
            blob = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if hits := leaks(blob, ns):
            found[f"/proc/{pid}/environ"] = hits
    outputs = {
        "admin status": lockstep(home, "status"),
        "admin status --json": lockstep(home, "--json", "status"),
        "admin deployments --json": lockstep(home, "--json", "deployments"),
        "gateway /admin/api/cluster/status": httpx.get(
            url + "/admin/api/cluster/status", headers=hdr, timeout=10).content,
        "gateway /admin/api/cluster/deployments": httpx.get(
            url + "/admin/api/cluster/deployments", headers=hdr, timeout=10).content,
        "gateway /metrics": httpx.get(url + "/metrics", timeout=10).content,
    }
    for name, blob in outputs.items():
        if hits := leaks(blob, ns):
            found[name] = hits
    status = json.loads(outputs["admin status --json"])
    for dep in status["data"]["deployments"]:
        assert dep["requests_key_sealed"] and not dep.get("requests_key")
    assert b"lockstep_bus_rejected" in outputs["gateway /metrics"]
    for f in sorted(p for p in home.rglob("*") if p.is_file()):
        mode = stat.S_IMODE(f.stat().st_mode)
        blob = f.read_bytes()
        if f in (*secret_paths, home / "keys" / "cluster.key"):  # where they belong
            assert mode == 0o600
            continue
        if hits := leaks(blob, ns):
            found[str(f.relative_to(home))] = hits
        top = f.relative_to(home).parts
        if top[0] in ("keys", "admin.token") or (top[0] == "runtime" and top[1] != "logs"):
            assert mode & 0o077 == 0, f"{f} has mode {mode:o}"  # keys and state: 0600
    if hits := leaks(out_path.read_bytes(), ns):
        found["lockstep up output"] = hits
    said = out_path.read_bytes() + b"".join(
        f.read_bytes() for f in (home / "runtime" / "logs").glob("gateway*.log"))
    assert b"loopback only" in said  # the gateway says where it binds (127.0.0.1)
    assert found == {}, f"secrets found: {found}"
    assert all(stat.S_IMODE(p.parent.stat().st_mode) & 0o077 == 0 for p in secret_paths)
