"""The fault soak (issue 8), driven by tests/faults/soak.py: a live gateway + supervisor +
reaper on loopback, real TP=2 MLX ranks, concurrent streaming clients, and a seeded
random schedule of faults (client disconnects, SIGKILL / SIGSTOP of random ranks, short
and beyond the peer grace, supervisor SIGKILL + restart, forged frames on every listening
ROUTER: admin, report, requests, plan), with the invariants checked after every fault.

- `test_fault_soak_short`: every fault kind once, in the normal suite (`make test`).
- `test_fault_soak_full` (`@pytest.mark.soak`, `make soak`): 200 faults or 10 minutes.

The seed is printed: fixed for the short soak (tests/faults/soak.py FIXED_SEED), new for
every full one; rerun one with LOCKSTEP_SOAK_SEED=N. Across hosts, with partitions:
tests/netns/test_soak_netns.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.soak import Budget, Soak, run_soak
from tests.faults.soak_clients import Waits
from tests.faults.soak_faults import FAULTS


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from models.tinymodel import build_model

    return build_model(tmp_path_factory.mktemp("model") / "tiny")


def _run(tmp_path: Path, model: Path, budget: Budget, random_seed: bool = False) -> None:
    run_soak(lambda seed: Soak(tmp_path, model, seed, budget), random_seed=random_seed)


@pytest.mark.timeout(300)
def test_fault_soak_short(tmp_path: Path, model: Path) -> None:
    every_kind_once = str(len(FAULTS))
    _run(tmp_path, model, Budget(faults=int(os.environ.get("LOCKSTEP_SOAK_FAULTS",
                                                           every_kind_once)), seconds=150.0))


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_fault_soak_full(tmp_path: Path, model: Path) -> None:
    # the gateway's own waits (admit_wait 60 s, resume_timeout 120 s), the clients' patience
    # beyond both (issue 43, item 7)
    _run(tmp_path, model, Budget(faults=200, seconds=600.0, waits=Waits.defaults()),
         random_seed=True)
