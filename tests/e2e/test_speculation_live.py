"""Speculative decoding through the whole server (issue 46): `lockstep up --speculative
ngram` serving the tiny preset at TP=2 and, deployed beside it, at PP=2 -- real ranks,
real mlx-lm caches, rank 0's prompt-lookup drafts carried in the plan and verified by
every rank in one step (services/rank/spec_step.py).

Drafts come from the test proposer behind rank 0's proposer seam (LOCKSTEP_TEST_DRAFTS_P:
what an earlier run of the same request emitted, each draft right with p = 0.5, else
another token -- the tiny preset's random weights never repeat, so prompt lookup alone
would rarely propose). Every request is first sent with `speculative: false`, then
twice at once, with and without (plain decoding in the same batch as its speculating
twin): greedy, seeded with penalties and logit_bias, n=2, top logprobs, a stop string
and a max_tokens that end inside an accepted run, a JSON schema (most wrong drafts are
tokens its grammar forbids). All three runs are equal, text, finish, every token's
logprob and its top alternatives; rank 0's counts in /metrics show drafts verified and
accepted.

On the parent commit `--speculative` is an unknown flag and up exits 2.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.gwutil import poll_until
from tests.support.up_cluster import UpOptions, deploy_tiny_pp_beside, up_cluster

NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: rows run to max_tokens
# Repeats: prompt lookup finds what follows the latest tokens earlier in the prompt
PROMPT = " ".join(["river", "mill", "lantern", "harbour", "quartz", "mill", "river"] * 9)
SCHEMA = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}


def cases(model: str, stop: str | None = None) -> dict[str, tuple[str, dict]]:
    """name -> (endpoint, body) without `speculative`."""
    base = {"model": model, "prompt": PROMPT, "logprobs": 3, "logit_bias": NO_EOS}
    out = {
        "greedy": ("/v1/completions", {**base, "max_tokens": 48, "temperature": 0}),
        "seeded": ("/v1/completions", {**base, "max_tokens": 48, "temperature": 0.8,
                                       "seed": 11, "presence_penalty": 0.5,
                                       "repetition_penalty": 1.1, "top_k": 40}),
        "n=2": ("/v1/completions", {**base, "max_tokens": 32, "temperature": 0.7, "seed": 5,
                                    "n": 2}),
        "max_tokens 7": ("/v1/completions", {**base, "max_tokens": 7, "temperature": 0}),
        "json schema": ("/v1/chat/completions", {
            "model": model, "max_tokens": 40, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "messages": [{"role": "user", "content": PROMPT}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "t", "schema": SCHEMA}}}),
    }
    if stop is not None:
        out["stop string"] = ("/v1/completions", {**base, "max_tokens": 48, "temperature": 0,
                                                  "stop": [stop]})
    return out


def result(r: httpx.Response) -> list:
    """Each choice's text (or message), finish and logprobs, whole."""
    assert r.status_code == 200, r.text
    out = []
    for ch in sorted(r.json()["choices"], key=lambda c: c["index"]):
        out.append((ch.get("text", (ch.get("message") or {}).get("content")),
                    ch["finish_reason"], ch["logprobs"]))
    return out


def twins(url: str, todo: dict[str, tuple[str, dict]],
          specs: tuple[bool, ...] = (False, True)) -> dict[str, dict[bool, list]]:
    """Every case with and without speculation (`specs`), all at once (one batch)."""
    got: dict[str, dict[bool, list]] = {k: {} for k in todo}

    def one(name: str, spec: bool) -> None:
        path, body = todo[name]
        try:
            got[name][spec] = result(httpx.post(url + path, timeout=180,
                                                json={**body, "speculative": spec}))
        except BaseException as exc:  # noqa: BLE001 - reported below, not lost in a thread
            got[name][spec] = [repr(exc)]

    threads = [threading.Thread(target=one, args=(k, s), daemon=True)
               for k in todo for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a request never ended"
    return got


def spec_counts(url: str, dep_id: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lockstep_rank0_spec_") and f'deployment="{dep_id}"' in line:
            name = line.split("{", 1)[0].removeprefix("lockstep_rank0_spec_")
            out[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("spec")
    opts = UpOptions(tp=2, extra=("--speculative", "ngram"), env={
        "LOCKSTEP_RANK_TEST_SEAMS": "true", "LOCKSTEP_TEST_DRAFTS_P": "0.5"})
    with up_cluster(home, opts) as c:
        deploy_tiny_pp_beside(c, home)
        yield c


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny", "tiny-pp"])
def test_speculating_requests_equal_plain_decoding_in_the_same_batch(cluster, model):
    c = cluster
    dep_id = next(d["deployment_id"] for d in c.deployments()
                  if d["model"] == model and d["state"] == "serving")
    before = spec_counts(c.url, dep_id)
    # a stop string from the middle of the greedy text: it ends inside a run of tokens
    plain = result(httpx.post(c.url + "/v1/completions", timeout=120, json={
        **cases(model)["greedy"][1], "speculative": False}))[0][0]
    stop = plain[len(plain) // 2: len(plain) // 2 + 6]
    assert stop.strip(), plain
    first = twins(c.url, cases(model, stop), specs=(False,))  # what the replay proposes
    got = twins(c.url, cases(model, stop))
    for name, pair in got.items():
        assert pair[False] == first[name][False], f"{name}: plain decoding varies"
        assert pair[True] == pair[False], f"{name}: speculation changed the output"
    assert got["stop string"][True][0][1] == "stop"
    assert got["max_tokens 7"][True][0][1] == "length"
    assert len(got["n=2"][True]) == 2

    def counted() -> dict | None:  # rank 0's telemetry comes once a second
        after = spec_counts(c.url, dep_id)
        grew = all(after.get(n, 0) > before.get(n, 0) for n in ("verify_steps", "accepted"))
        return after if grew else None
    after = poll_until(counted, 10, "rank 0's counts of verify steps and accepted drafts")
    print(f"{model}: {after} (before: {before})")


def test_speculative_must_be_true_or_false(cluster):
    r = httpx.post(cluster.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "speculative": "yes"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculative", r.text


def test_the_banner_models_and_status_say_it(cluster):
    c = cluster
    assert "speculative:     ngram (rank 0 proposes drafts" in c.text()
    models = httpx.get(c.url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["speculation"] for m in models} == {"tiny": "ngram", "tiny-pp": "ngram"}
    st = httpx.get(c.url + "/admin/api/cluster/status", headers=c.hdr, timeout=10).json()
    assert {d["speculation"] for d in st["deployments"]} == {"ngram"}
