"""Ranks on remote hosts, through the host agent over ssh (`services.hostagent`,
`common.ssh`): every ssh in batch mode with a connect timeout and keep-alives, under a
deadline; nothing secret on a command line.

A remote host keeps the same layout under its own $LOCKSTEP_HOME (host record `home`,
default the supervisor's): the launch secret at runtime/secrets/<job>.key, the MLX
hostfile and the rank specs in runtime/jobs/<job>/, markers in runtime/markers/<dep>/,
rank output in runtime/logs/. `SshLauncher` writes those files (`write-file`, 0600),
probes ports there (`free-ports`), starts each rank (`spawn`, its environment as JSON on
stdin, the rank's environment rules applied on that host by `--rank-env`) and removes
the launch files after a proven teardown (`remove-files`).
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.messages import Backend
from common.ssh import SshError, SshTarget
from services.hostagent.client import RemoteHost, idents_json, remove_launch_files
from services.hostagent.replies import FreePorts, Removed, Spawned
from services.supervisor.hosts import Member
from services.supervisor.process_launcher import ROOT, LaunchFailed, Started

__all__ = ["RemoteHost", "SshLauncher", "idents_json", "parallel"]

log = logging.getLogger("lockstep.supervisor")


def parallel(fn, items: list) -> list:
    """fn over items in threads (ssh round trips are latency, not CPU); results in order,
    the first exception re-raised after all finished."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
        futures = [pool.submit(fn, i) for i in items]
        return [f.result() for f in futures]


class SshLauncher:
    """Starts ranks on remote hosts. Settings: ssh_config (default client config),
    ssh_connect_timeout, ssh_command_timeout; `home` is the supervisor's own."""

    def __init__(self, *, home: Path, ssh_config: str = "", connect_timeout: float = 5.0,
                 command_timeout: float = 30.0) -> None:
        self.home = Path(home).expanduser().absolute()
        self.ssh_config = ssh_config
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout

    def host(self, m: Member) -> RemoteHost:
        config = m.ssh_config or self.ssh_config or None
        target = SshTarget(m.ssh, config_file=config, connect_timeout=self.connect_timeout)
        return RemoteHost(name=m.host, target=target, python=m.python or sys.executable,
                          home=m.home or str(self.home), cwd=m.cwd or str(ROOT),
                          timeout=self.command_timeout + self.connect_timeout)

    def free_ports(self, host: RemoteHost, n: int, ip: str) -> list[int]:
        try:
            ports = host.ask(FreePorts, "free-ports", str(n), "--host", ip).ports
        except SshError as exc:
            raise LaunchFailed(f"host {host.describe()}: cannot probe ports on {ip}: "
                               f"{exc}") from None
        if len(set(ports)) != n:
            raise LaunchFailed(f"host {host.describe()}: free-ports gave {ports}")
        return ports

    def write_file(self, host: RemoteHost, path: str, data: bytes) -> None:
        try:
            host.agent("write-file", path, "--mode", "600", "--parents", input=data)
        except SshError as exc:
            raise LaunchFailed(f"host {host.describe()}: cannot write {path}: {exc}") from None

    def spawn(self, host: RemoteHost, argv: list[str], env: Mapping[str, str | None],
              log_path: str, *, rank: int) -> Started:
        args = ["--cwd", host.cwd, "--log", log_path, "--env-json-stdin", "--rank-env",
                "--", *argv]
        try:
            info = host.ask(Spawned, "spawn", *args, input=json.dumps(dict(env)).encode())
        except SshError as exc:
            raise LaunchFailed(f"rank {rank} on {host.describe()}: cannot start "
                               f"{shlex.join(argv[:4])}: {exc}") from None
        return Started(info.ident(), info.pgid, None, Path(log_path), remote=True,
                       ssh=host.target.target)

    def remove_launch_files(self, host: RemoteHost, job_id: str,
                            deployment_id: str | None) -> Removed:
        return remove_launch_files(host, job_id, deployment_id)


def remote_rank_argv(rank_command: str, python: str, spec_path: str) -> list[str]:
    """`rank_command` as it is when set (tests: the fake rank), else the real rank with
    that host's interpreter."""
    base = shlex.split(rank_command) or [python, "-m", "services.rank"]
    return [*base, "--spec", spec_path]


def remote_env(*, plan_envs: list[str], extra: Mapping[str, str], rank: int, home: str,
               job_id: str, backend: Backend, hostfile: str, coordinator: str = ""
               ) -> dict[str, str | None]:
    """Only the rank's own variables: the plan's envs (hosts file and deploy), the
    supervisor's extra rank env, MLX_RANK, LOCKSTEP_HOME and LOCKSTEP_JOB_ID, the MLX
    hostfile. The DESIGN 5.3 defaults and the OpenBLAS preload are applied on the host
    (`spawn --rank-env`), yielding to what is set there or here. None removes a variable
    the remote login environment may carry."""
    env: dict[str, str | None] = {}
    for item in plan_envs:
        k, _, v = item.partition("=")
        if k:
            env[k] = v
    env.update(extra)
    env.update({"MLX_RANK": str(rank), "LOCKSTEP_HOME": home, "LOCKSTEP_JOB_ID": job_id,
                "TEMP": None})
    if backend == Backend.RING:
        env["MLX_HOSTFILE"] = hostfile
    elif backend == Backend.JACCL:
        env["MLX_IBV_DEVICES"] = hostfile
        env["MLX_JACCL_COORDINATOR"] = coordinator
        env["MLX_HOSTFILE"] = None
    else:
        env["MLX_HOSTFILE"] = None
    return env


def hosts_of(members: list[Member], launcher: SshLauncher) -> dict[int, RemoteHost]:
    """host index → RemoteHost, for the remote members."""
    return {m.host_index: launcher.host(m) for m in members if not m.local}
