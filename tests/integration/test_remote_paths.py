"""The remote paths without network namespaces: the host agent's newer commands (probe,
remove-files, free-ports, spawn --rank-env) and the reaper's ssh path, driven through a
local target (`common.ssh.run` runs a 127.0.0.1 target directly, without ssh), and a
host that cannot be reached (an ssh client config whose ProxyCommand fails: no packet
leaves this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.atomic_json import read_json
from common.home import Paths, manifest_path, write_manifest, write_marker
from common.procs import identify
from common.records import LaunchManifest, Phase, RankMarker, RankRecord
from common.ssh import SshError
from services.reaper.reap import reap_orphans
from services.reaper.remote import SshRemoteReaper
from services.supervisor.remote import remote_env, remote_rank_argv
from tests.fakes.procwatch import process_gone
from tests.support.hostagent import LOCAL, agent
from tests.support.hostagent import spawn as agent_spawn

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def spawned():
    infos: list[dict] = []

    def spawn(argv: list[str], log: Path, env: dict | None = None, *extra: str) -> dict:
        info = agent_spawn(argv, log=log, cwd=ROOT, env=env, extra=extra)
        infos.append(info)
        return info

    yield spawn
    for info in infos:
        agent("signal", str(info["pid"]), repr(info["start_time"]), "KILL", "--cmdline-json",
              json.dumps(info["cmdline"]))


def test_probe_tells_alive_gone_reused_and_ambiguous(tmp_path):
    me = identify(os.getpid())
    dead = subprocess.Popen(["true"])
    dead.wait()
    idents = [
        {"pid": me.pid, "start_time": me.start_time, "cmdline": list(me.cmdline)},
        {"pid": dead.pid, "start_time": me.start_time, "cmdline": ["true"]},
        {"pid": me.pid, "start_time": me.start_time - 50, "cmdline": list(me.cmdline)},
        {"pid": me.pid, "start_time": me.start_time, "cmdline": ["something", "else"]},
    ]
    home = tmp_path / "home"
    write_marker(Paths(home), RankMarker(
        deployment_id="d1", job_id="j1", rank=0, host="h", pid=me.pid,
        start_time=me.start_time, phase=Phase.READY, updated_at=time.time()))
    ans = agent("probe", "--identities-json", json.dumps(idents), "--home", str(home),
                "--deployment", "d1")
    assert [p["state"] for p in ans["processes"]] == ["alive", "gone", "reused", "ambiguous"]
    assert [m["marker"]["pid"] for m in ans["markers"]] == [me.pid]
    assert "markers" not in agent("probe", "--identities-json", "[]")


def test_remove_files_only_below_runtime_areas(tmp_path):
    home = tmp_path / "home"
    p = Paths(home).ensure()
    secret = p.secrets / "j1.key"
    secret.write_text("00")
    job = p.runtime / "jobs" / "j1"
    job.mkdir(parents=True)
    (job / "rank-0.spec.json").write_text("{}")
    outside = tmp_path / "precious"
    outside.write_text("keep")
    (p.runtime / "jobs" / "escape").symlink_to(tmp_path)
    for bad in (str(outside), str(p.secrets), str(p.runtime),
                str(p.runtime / "jobs" / "escape" / "precious"), "relative/path"):
        with pytest.raises(SshError, match="remove-files"):
            agent("remove-files", "--home", str(home), str(secret), bad)
        assert secret.exists() and outside.exists()  # checked before anything goes
    ans = agent("remove-files", "--home", str(home), str(secret), str(job),
                str(p.markers / "nothing"))
    assert ans == {"removed": [str(secret), str(job)], "missing": [str(p.markers / "nothing")]}
    assert not secret.exists() and not job.exists() and outside.exists()


def test_free_ports_are_distinct_and_bindable():
    ports = agent("free-ports", "5", "--host", LOCAL)["ports"]
    assert len(set(ports)) == 5 and all(1024 < p < 65536 for p in ports)
    with pytest.raises(SshError, match="count"):
        agent("free-ports", "0")


def test_spawn_rank_env_applies_the_rank_rules_there(spawned, tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    env = {"MLX_MAX_MB_PER_BUFFER": "64", "TEMP": "/x", "MLX_RANK": "1"}
    info = spawned(argv, tmp_path / "r.log", env, "--rank-env")
    environ = dict(e.split("=", 1) for e in
                   Path(f"/proc/{info['pid']}/environ").read_text().split("\0") if "=" in e)
    assert environ["MLX_MAX_OPS_PER_BUFFER"] == "16"  # a default, applied there
    assert environ["MLX_MAX_MB_PER_BUFFER"] == "64"  # the value sent wins
    assert environ["MLX_RANK"] == "1" and "TEMP" not in environ


def test_remote_env_and_argv_carry_only_the_rank_s_own_variables():
    env = remote_env(plan_envs=["A=1", "B=x=y"], extra={"LOCKSTEP_FAKE_X": "1"}, rank=1,
                     home="/h", job_id="j1", backend="ring", hostfile="/h/hf.json")
    assert env == {"A": "1", "B": "x=y", "LOCKSTEP_FAKE_X": "1", "MLX_RANK": "1",
                   "LOCKSTEP_HOME": "/h", "LOCKSTEP_JOB_ID": "j1", "TEMP": None,
                   "MLX_HOSTFILE": "/h/hf.json"}
    single = remote_env(plan_envs=[], extra={}, rank=0, home="/h", job_id="j", backend="none",
                        hostfile="")
    assert single["MLX_HOSTFILE"] is None  # removed from the login environment there
    assert remote_rank_argv("", "/opt/py", "/h/s.json") == [
        "/opt/py", "-m", "services.rank", "--spec", "/h/s.json"]
    assert remote_rank_argv("py -m tests.fakes.fake_rank", "/opt/py", "/s") == [
        "py", "-m", "tests.fakes.fake_rank", "--spec", "/s"]


# --- the reaper's remote path ---------------------------------------------------------


def _orphan(paths: Paths, job: str, dep: str, ranks: list[RankRecord]) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    (paths.secrets / f"{job}.key").write_text("00" * 32)
    write_manifest(paths, LaunchManifest(
        job_id=job, deployment_id=dep, supervisor_pid=dead.pid, supervisor_start_time=1.0,
        supervisor_boot_id="t", created_at=time.time(), ranks=ranks,
        secret_path=str(paths.secrets / f"{job}.key")))


def _record(info: dict, rank: int, rhome: Path, dep: str, **kw) -> RankRecord:
    args = {"rank": rank, "host": "far", "pid": info["pid"], "pgid": info["pgid"],
            "start_time": info["start_time"], "cmdline": info["cmdline"],
            "marker_dir": str(Paths(rhome).markers / dep), "remote": True, "ssh": LOCAL,
            "python": sys.executable, "home": str(rhome)}
    return RankRecord(**{**args, **kw})


def test_reaper_stops_remote_ranks_through_the_agent(spawned, tmp_path):
    paths = Paths(tmp_path / "home").ensure()
    rhome = tmp_path / "remote-home"
    there = Paths(rhome).ensure()
    (there.secrets / "j1.key").write_text("00" * 32)
    (there.runtime / "jobs" / "j1").mkdir(parents=True)
    argv = [sys.executable, "-m", "tests.fakes.sleeper_rank", "--home", str(rhome),
            "--deployment", "d1", "--job", "j1", "--rank", "1"]
    info = spawned(argv, tmp_path / "s.log", {"LOCKSTEP_FAKE_IGNORE_TERM": "1"})
    _orphan(paths, "j1", "d1", [_record(info, 1, rhome, "d1")])
    report = reap_orphans(paths, term_timeout=1.0, kill_timeout=3.0,
                          remote=SshRemoteReaper(paths))
    assert report.reaped == ["j1"] and report.steps["j1"] == ["sigterm", "sigkill"], report
    assert process_gone(info["pid"])
    assert not manifest_path(paths, "j1").exists()
    assert [f for f in (there.secrets / "j1.key", there.runtime / "jobs" / "j1",
                        there.markers / "d1") if f.exists()] == []


def test_unreachable_host_is_a_named_failure_and_keeps_the_manifest(tmp_path):
    paths = Paths(tmp_path / "home").ensure()
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  ProxyCommand /bin/false\n")  # fails without any network
    fake = {"pid": 4242, "pgid": 4242, "start_time": 1.0, "cmdline": ["x", "--spec", "j2"]}
    _orphan(paths, "j2", "d2", [_record(fake, 0, tmp_path / "rh", "d2", ssh="root@far-host",
                                        ssh_config=str(config))])
    t0 = time.monotonic()
    report = reap_orphans(paths, term_timeout=1.0, kill_timeout=1.0,
                          remote=SshRemoteReaper(paths, connect_timeout=2.0))
    assert time.monotonic() - t0 < 20
    (failure,) = report.failures
    assert "root@far-host" in failure["reason"] and failure["survivors"][0]["pid"] == 4242
    kept = LaunchManifest.from_dict(read_json(manifest_path(paths, "j2")))
    assert kept.teardown_failures and "far-host" in kept.teardown_failures[-1]


def test_ambiguous_remote_identity_is_neither_signalled_nor_called_gone(spawned, tmp_path):
    paths = Paths(tmp_path / "home").ensure()
    info = spawned([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "a.log")
    rec = _record({**info, "cmdline": ["recorded", "differently"]}, 0, tmp_path / "rh", "d3")
    _orphan(paths, "j3", "d3", [rec])
    report = reap_orphans(paths, term_timeout=1.0, kill_timeout=1.0,
                          remote=SshRemoteReaper(paths))
    (failure,) = report.failures
    assert "ambiguous" in failure["reason"] and manifest_path(paths, "j3").exists()
    assert identify(info["pid"]) is not None  # not signalled
