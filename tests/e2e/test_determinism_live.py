"""Determinism through the whole server (issue 41), on the shared cluster's TP=2
deployment (tests/support/live_cluster.py: `lockstep up`, real ranks over ring):

four probes (tests/support/probes.py) sent alone, one after another, with the prefix
cache emptied before each; then the four at once with six companions of other prompt
lengths arriving while they stream (cache emptied again; rank 0 held while the four
are sent, so that they start together); then the four again, their
prompts now in the prefix cache. Every stream's tokens and every logprob must equal the
probe's run alone, bit for bit. With `--no-deterministic` this fails at the first token
of the run in company (logprobs ~2e-6 apart).
"""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.support import live_cluster as lc
from tests.support.probes import PROBES, assert_same, clear_cache, held_at_rank0, run_probes


@pytest.mark.timeout(600)
def test_probes_are_identical_alone_in_company_and_from_the_prefix_cache(live_cluster):
    c = live_cluster
    models = httpx.get(c.url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["determinism"] for m in models}[lc.TP_MODEL] == "on", models
    assert "deterministic:   on (batch-invariant)" in c.text()
    dep = c.deps[lc.TP_MODEL]["deployment_id"]
    clear_cache(c.url, c.hdr, dep)
    alone = {}
    for kind in PROBES:  # one at a time: each probe alone in the batch
        alone.update(run_probes(c.url, lc.TP_MODEL, [kind]))
        clear_cache(c.url, c.hdr, dep)
    assert all(len(v) == 60 for r in alone.values() for v in r["choices"].values()), alone
    assert len(alone["n2"]["choices"]) == 2
    # rank 0 is held while the four are sent, so they start together whatever each
    # took the gateway to prepare: the six companions then find all four streaming
    hold = functools.partial(held_at_rank0, c.url, c.hdr, c.deps[lc.TP_MODEL])
    assert_same(run_probes(c.url, lc.TP_MODEL, list(PROBES), companions=6, hold=hold), alone,
                "beside six companions")
    # their prompts were stored by the last run: now each starts from the prefix cache
    assert_same(run_probes(c.url, lc.TP_MODEL, list(PROBES)), alone, "from the prefix cache")
