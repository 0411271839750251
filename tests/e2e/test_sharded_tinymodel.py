"""The embedded model really runs sharded: TP=2 and PP=2 over MLX's ring backend give the
same greedy tokens as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.tinymodel import build_model
from tests.e2e.ring_sharded_check import greedy_ids
from tests.support.ports import free_ports
from tests.support.processes import kill_group

SCRIPT = Path(__file__).with_name("ring_sharded_check.py")
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tinymodel") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[int]:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    return greedy_ids(model, tokenizer)


def _logs(tmp_path: Path) -> dict[int, str]:
    return {r: (tmp_path / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in range(2)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_ring_sharded_matches_single_process(mode, model_dir, reference, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    out = tmp_path / "tokens.json"
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(2):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            # The child keeps its own copy of the descriptor; ours can close at once.
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), str(model_dir), mode, str(out)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + DEADLINE_S
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{mode} ranks still running after {DEADLINE_S}s: {_logs(tmp_path)}")
        assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)
    finally:
        for p in procs:  # each rank leads its own session: this reaches its children too
            kill_group(p)
    result = json.loads(out.read_text())
    assert result["size"] == 2
    assert result["tokens"] == reference
