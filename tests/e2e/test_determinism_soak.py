"""Determinism, the long checks (`make soak`, issue 41): the probes of
tests/support/probes.py on the bench preset at one rank and at PP=2; a long prompt whose
prefill is chunked by load (rank 0's policy while streams decode) against the same prompt
prefilled alone; and the replica failover test eight times in a row at 300 tokens.
(Resume at k = 250 is a soak case of tests/e2e/test_resume_live.py; prefill chunks 32,
128 and 512 on the bench preset are tests/unit/test_batch_invariance.py's soak case.)
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import pytest

from tests.gwutil import poll_until
from tests.support.probes import (
    NO_EOS,
    PROBES,
    assert_same,
    clear_cache,
    held_at_rank0,
    probe_body,
    run_probes,
    stream_chat,
)
from tests.support.processes import REPO
from tests.support.up_cluster import UpCluster, UpOptions, up_cluster

pytestmark = pytest.mark.soak
READY_S = 600.0  # the bench preset, larger than tiny, is built before it is deployed


def _serving(c: UpCluster) -> dict:
    return next(d for d in c.deployments() if d["state"] == "serving")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("pp", [1, 2], ids=["one-rank", "pp2"])
def test_probes_identical_on_the_bench_preset(tmp_path, pp):
    with up_cluster(tmp_path, UpOptions(model="bench", tp=1, pp=pp, ready_s=READY_S)) as c:
        serving = _serving(c)
        model, dep = serving["model"], serving["deployment_id"]
        assert serving["determinism"] == "on"
        alone = {}
        for kind in PROBES:
            clear_cache(c.url, c.hdr, dep)
            alone.update(run_probes(c.url, model, [kind]))
        clear_cache(c.url, c.hdr, dep)
        hold = functools.partial(held_at_rank0, c.url, c.hdr, serving)
        assert_same(run_probes(c.url, model, list(PROBES), companions=6, hold=hold), alone,
                    "beside six companions")
        assert_same(run_probes(c.url, model, list(PROBES)), alone, "from the prefix cache")


@pytest.mark.timeout(1200)
def test_a_long_prompt_chunked_by_load_equals_it_prefilled_alone(tmp_path):
    """--prefill-long-prompt 64: while streams decode, rank 0 sizes the probe's prompt
    chunks from its step times (services/rank/prefill_policy.py); alone, nothing decodes
    and it prefills in chunks of 512."""
    opts = UpOptions(tp=2, extra=("--prefill-long-prompt", "64"), ready_s=READY_S)
    with up_cluster(tmp_path, opts) as c:
        dep_info = _serving(c)
        model, dep = dep_info["model"], dep_info["deployment_id"]
        prompt = " ".join(f"Line {i}: the mill turns and the river runs." for i in range(120))
        alone = run_probes(c.url, model, ["greedy"], prompt=prompt)
        clear_cache(c.url, c.hdr, dep)
        out: dict = {}
        lock = threading.Lock()
        busy = [threading.Thread(target=stream_chat, args=(c.url, {
            "model": model, "stream": True, "max_tokens": 300, "temperature": 0,
            "logit_bias": NO_EOS, "messages": [{"role": "user", "content": f"count {i}"}]},
            out, f"busy{i}", lock), daemon=True) for i in range(4)]
        for t in busy:
            t.start()
        poll_until(lambda: len(out.get("progress") or {}) == 4, 60, "four streams decoding")
        stream_chat(c.url, probe_body(model, "greedy", prompt=prompt), out, "greedy", lock)
        assert "error" not in out["greedy"], out["greedy"]
        assert all(k not in out for k in ("busy0", "busy1", "busy2", "busy3")), \
            "a stream ended before the probe: its prefill may not have been load-sized"
        for t in busy:
            t.join(240)
        assert_same({"greedy": out["greedy"]}, alone, "prefilled in load-sized chunks")


@pytest.mark.timeout(3600)
def test_replica_failover_eight_times_in_a_row(tmp_path):
    """tests/e2e/test_replicas_live.py's failover (six seeded 300-token streams, one
    replica's rank SIGKILLed, every stream resumed on the other and equal to its
    unfaulted run), eight fresh runs; every one must pass."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for i in range(8):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/e2e/test_replicas_live.py", "-k", "killed", "--basetemp",
             str(tmp_path / f"run{i}")], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=900)
        assert done.returncode == 0, f"run {i + 1} of 8:\n{done.stdout[-4000:]}"
