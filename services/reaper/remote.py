"""Reaping orphaned ranks on remote hosts (the `RemoteReaper` seam of `reap.py`), over
ssh through the host agent, with the same proof rules as local ranks:

  per host (hosts in parallel): probe → a rank whose pid now holds another start time
  has exited; one with the recorded start time but another command line is ambiguous
  (neither signalled nor called gone) → the live ones: SIGTERM → wait → SIGKILL → wait
  → SIGKILL → wait, each signal identity-checked there (a group only while a recorded
  member still lives in it) → every exit proven there → the launch secret and job files
  on that host removed (and the deployment's markers there, unless another manifest
  names the deployment).

A host that cannot be reached proves nothing: its ranks are survivors, with the reason,
and the manifest stays for the next pass. The rank records carry what reaching the host
takes (ssh target, interpreter, home, ssh client config); `ssh_config` here is the
fallback for a record without one.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common.home import Paths, read_manifests
from common.messages.vocab import ProcState
from common.procs import ProcessIdentity
from common.records import LaunchManifest, RankRecord
from common.ssh import SshError, SshTarget
from services.hostagent import client
from services.hostagent.client import STEPS, Ladder, RemoteHost
from services.reaper.reap import RemoteOutcome

log = logging.getLogger("lockstep.reaper")


def _home_of(r: RankRecord) -> str:
    # marker_dir is <home>/runtime/markers/<deployment> on that host
    return r.home or str(Path(r.marker_dir).parents[2])


class SshRemoteReaper:
    def __init__(self, paths: Paths, *, ssh_config: str = "", connect_timeout: float = 5.0,
                 command_timeout: float = 30.0) -> None:
        self.paths = paths
        self.ssh_config = ssh_config
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout

    def host_of(self, r: RankRecord) -> RemoteHost:
        if not r.ssh:
            raise ValueError(f"rank {r.rank} on {r.host}: no ssh target recorded")
        target = SshTarget(r.ssh, config_file=r.ssh_config or self.ssh_config or None,
                           connect_timeout=self.connect_timeout)
        return RemoteHost(name=r.host, target=target, python=r.python or sys.executable,
                          home=_home_of(r), timeout=self.command_timeout + self.connect_timeout)

    def __call__(self, manifest: LaunchManifest, ranks: list[RankRecord], *,
                 term_timeout: float, kill_timeout: float) -> RemoteOutcome:
        groups: dict[tuple, list[RankRecord]] = {}
        for r in ranks:
            groups.setdefault((r.ssh, r.python, _home_of(r), r.ssh_config), []).append(r)

        def one(rs: list[RankRecord]) -> tuple[list[dict[str, Any]], list[str]]:
            return self._reap_host(manifest, rs, term_timeout, kill_timeout)

        with ThreadPoolExecutor(max_workers=max(1, min(8, len(groups)))) as pool:
            parts = list(pool.map(one, list(groups.values())))
        taken = {step for _, path in parts for step in path}
        return RemoteOutcome([s for left, _ in parts for s in left],
                             [step for step, _ in STEPS if step in taken])

    def _reap_host(self, manifest: LaunchManifest, ranks: list[RankRecord],
                   term_timeout: float, kill_timeout: float
                   ) -> tuple[list[dict[str, Any]], list[str]]:
        def failed(rs: list[RankRecord], why: str) -> list[dict[str, Any]]:
            return [{"rank": r.rank, "host": r.host, "pid": r.pid, "reason": why} for r in rs]

        try:
            host = self.host_of(ranks[0])
        except ValueError as exc:
            return failed(ranks, str(exc)), []
        idents = [ProcessIdentity(r.pid, r.start_time, tuple(r.cmdline)) for r in ranks]
        try:
            states = client.probe(host, idents).states()
        except SshError as exc:
            return failed(ranks, f"probe of {host.describe()} failed: {exc}"), []
        out = failed([r for r in ranks if states.get(r.pid) == ProcState.AMBIGUOUS],
                     "identity ambiguous there: start time matches, command line differs; "
                     "not signalled, not proven gone")
        live = [i for i in idents if states.get(i.pid) == ProcState.ALIVE]
        lad = Ladder(left=live)
        client.run_ladder(host, lad, {r.pid: r.pgid for r in ranks},
                          term_timeout=term_timeout, kill_timeout=kill_timeout)
        by_pid = {r.pid: r for r in ranks}
        why = lad.error or f"survived {' → '.join(lad.path)} on {host.describe()}"
        out += failed([by_pid[i.pid] for i in lad.left], why)
        log.warning("job %s on %s: %d rank(s) live, steps %s, %d not proven", manifest.job_id,
                    host.describe(), len(live), lad.path or ["none alive"], len(out))
        if not out:
            self._remove_files(host, manifest)
        return out, lad.path

    def _remove_files(self, host: RemoteHost, manifest: LaunchManifest) -> None:
        """Every rank there is proven gone: their launch files go (best effort: a
        leftover secret opens nothing running)."""
        scan = read_manifests(self.paths)
        others = any(m.deployment_id == manifest.deployment_id and m.job_id != manifest.job_id
                     for _, m in scan.manifests)
        keep_markers = others or bool(scan.unreadable)
        try:
            client.remove_launch_files(host, manifest.job_id,
                                       None if keep_markers else manifest.deployment_id)
        except SshError as exc:
            log.error("job %s: launch files on %s not removed: %s", manifest.job_id,
                      host.describe(), exc)
