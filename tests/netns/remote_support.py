"""Helpers for the supervisor/reaper tests on network-namespace hosts: hosts files that
point at the cluster's hosts (each with its own $LOCKSTEP_HOME), and evidence that
nothing of a launch is left on a host, read over ssh *and* with psutil (the namespaces
share this machine's pid space and file system)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.home import Paths
from common.procs import START_TIME_TOLERANCE
from tests.netns.hosts import PYTHON, REPO_ROOT, NetnsCluster
from tests.support.polling import wait_for as poll_for
from tests.support.processes import netns_of
from tests.support.processes import process_gone as gone_locally

__all__ = ["assert_nothing_left", "gone_locally", "gone_over_ssh", "host_record", "hosts_doc",
           "launch_files", "netns_of", "poll_for", "remote_home"]


def remote_home(c: NetnsCluster, i: int) -> Path:
    return c.host_dir(i) / "home"


def host_record(c: NetnsCluster, i: int, **extra: Any) -> dict[str, Any]:
    """An mlx.launch host entry for host i plus Lockstep's optional fields."""
    return {"name": c.names[i], "ssh": f"{c.user}@{c.address(i)}", "ips": [c.address(i)],
            "python": PYTHON, "home": str(remote_home(c, i)), "cwd": str(REPO_ROOT),
            "ssh_config": str(c.ssh_config), "rdma_ctl": False, "rdma_devices": [], **extra}


def hosts_doc(c: NetnsCluster, hosts: list[int], **extra: Any) -> dict[str, Any]:
    return {"backend": "ring", "envs": [], "hosts": [host_record(c, i, **extra) for i in hosts]}


def gone_over_ssh(c: NetnsCluster, host: int, pid: int, start_time: float) -> bool:
    ident = c.agent(host, "identify", str(pid))
    return ident is None or abs(ident["start_time"] - start_time) > START_TIME_TOLERANCE


def launch_files(c: NetnsCluster, host: int, job_id: str, deployment_id: str) -> list[Path]:
    """What of a launch exists under host i's home (secret, job dir, markers)."""
    p = Paths(remote_home(c, host))
    return [f for f in (p.secrets / f"{job_id}.key", p.runtime / "jobs" / job_id,
                        p.markers / deployment_id) if f.exists()]


def assert_nothing_left(c: NetnsCluster, ranks: list[dict[str, Any]], job_id: str,
                        deployment_id: str) -> None:
    """Every rank ({host index, pid, start_time}) gone, by ssh and by psutil, and no
    launch files left on its host."""
    for r in ranks:
        assert gone_over_ssh(c, r["host"], r["pid"], r["start_time"]), r
        assert gone_locally(r["pid"], r["start_time"]), r
    for h in sorted({r["host"] for r in ranks}):
        assert launch_files(c, h, job_id, deployment_id) == [], c.names[h]
