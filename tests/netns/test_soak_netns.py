"""The fault soak (tests/faults/soak.py) across hosts: the same live gateway + supervisor +
reaper (on the control host, this machine's root namespace), but the TP=2 deployment's
ranks on two network-namespace hosts reached over ssh (rank 0 on host A, rank 1 on host
B, ring backend between them), and two more faults beside the soak's own: a partition of
host B shorter than the peer abort grace (the deployment may recover, or be lost and
redeployed: both are legal, a hang is not) and one longer than the grace (rank 0
`peer_lost`, the teardown of host B's rank waits for the link, then proof).

The invariants after every fault are the soak's: no process of a stopped deployment
alive (the namespaces share this machine's pid space), no manifest without a live
supervisor, gateway and rank active counts agree when quiescent, every client stream
ended with content, abort or a clear error.

- `test_fault_soak_across_hosts_short`: every fault kind once (8), in `make test`.
- `test_fault_soak_across_hosts_full` (`soak` marker, `make soak`): 200 faults or 10 min.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from common.home import Paths
from tests.faults.soak import Budget, Soak, run_soak
from tests.faults.soak_faults import FAULTS, WEIGHTS
from tests.netns.hosts import NetnsCluster
from tests.netns.remote_support import hosts_doc, remote_home

pytestmark = pytest.mark.netns

A, B = 0, 1


class NetnsSoak(Soak):
    faults = (*FAULTS, "partition_short", "partition_long")
    weights = (*WEIGHTS, 2, 1)
    adopts = False  # a killed supervisor's remote launch is stopped and redeployed

    def __init__(self, c: NetnsCluster, tmp: Path, model: Path, seed: int,
                 budget: Budget) -> None:
        self.c = c
        super().__init__(tmp, model, seed, budget)

    def supervisor_env(self) -> dict[str, str]:
        return {"LOCKSTEP_SSH_CONNECT_TIMEOUT": "3", "LOCKSTEP_REMOTE_POLL_S": "0.3"}

    def deploy_args(self) -> dict:
        return {"hosts": hosts_doc(self.c, [A, B])["hosts"]}

    def rank0_spec(self, job_id: str) -> Path:
        return Paths(remote_home(self.c, A)).runtime / "jobs" / job_id / "rank-0.spec.json"

    def _f_partition_short(self) -> None:
        self.c.link_down(B)
        try:
            time.sleep(self.rng.uniform(0.5, 1.5))  # the fault's duration
        finally:
            self.c.link_up(B)

    def _f_partition_long(self) -> None:
        self.c.link_down(B)
        try:
            self._expect_down()  # peer_lost after the grace; host B's rank unreachable
        finally:
            self.c.link_up(B)


def _run(c: NetnsCluster, tmp_path: Path, budget: Budget, random_seed: bool = False) -> None:
    from tests.e2e.rank_harness import model_dir

    run_soak(lambda seed: NetnsSoak(c, tmp_path, model_dir(), seed, budget),
             "soak across hosts", random_seed=random_seed)


@pytest.mark.timeout(600)
def test_fault_soak_across_hosts_short(netns_cluster, tmp_path: Path) -> None:
    _run(netns_cluster, tmp_path,
         Budget(faults=int(os.environ.get("LOCKSTEP_SOAK_FAULTS",
                                          str(len(NetnsSoak.faults)))), seconds=150.0))


@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_fault_soak_across_hosts_full(netns_cluster, tmp_path: Path) -> None:
    _run(netns_cluster, tmp_path, Budget(faults=200, seconds=600.0), random_seed=True)
