"""The KV budget through the whole server (issue 45 items 1, 2 and 6): `lockstep up` with
`--kv-budget-bytes 2000000` serving the tiny preset at TP=2 and, deployed beside it, at
PP=2 -- real ranks, real mlx-lm caches.

A flood of 24 requests (greedy and seeded, streamed and not), all in rank 0's queue at
once, whose KV together is more than 4 times the budget: all complete, each with the
tokens and logprobs of its run alone (determinism is on); rank 0 made the queue's head
wait (its own counts); every rank's own measure of its caches (their nbytes after every
step, in telemetry) never passed the budget, and came within reach of it. Then two
requests sized so that they must outgrow the budget together: rank 0 preempts one (a
preempted request comes back as prompt + its tokens, its client sees only a pause), and
both equal their runs alone. A prompt that cannot fit alone is refused at once with a 400
naming the budget, in the OpenAI and Anthropic shapes, and the service keeps serving.
Status, the banner and /metrics show the budget.

On the parent commit (no budget) `--kv-budget-bytes` is an unknown flag and up exits 2.
"""

from __future__ import annotations

import functools
import threading
import time

import httpx
import pytest

from common.home import Paths
from services.rank.kv_budget import GROWTH
from services.rank.removals import read_removals, removals_path
from tests.gwutil import poll_until, sse_lines
from tests.support.probes import FREEZE_S, held_at_rank0, rank0_frozen
from tests.support.up_cluster import UpOptions, deploy_tiny_pp_beside, up_cluster

BUDGET = 2_000_000
# Three API keys (tenants): alice and bob weigh 10, carol 1 and may not ask a priority
# more urgent than 0; each key's share of the 84 requests in flight: 40, 40 and 4.
KEYS = {"LOCKSTEP_API_KEYS": "alice:ka,bob:kb,carol:kc",
        "LOCKSTEP_API_KEY_WEIGHTS": "alice=10,bob=10,carol=1",
        "LOCKSTEP_API_KEY_MAX_PRIORITY": "carol=0", "LOCKSTEP_MAX_INFLIGHT": "84"}
ALICE, BOB, CAROL = ({"authorization": f"Bearer {k}"} for k in ("ka", "kb", "kc"))
NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: every row runs to max_tokens
MAX_TOKENS = 60


def prompt(i: int) -> str:
    return " ".join(["river", "mill", "lantern", "harbour", "quartz"][(i + k) % 5]
                    for k in range(12 + 5 * i))


def complete(url: str, model: str, i: int, stream: bool = False,
             prompt_tokens: dict[int, int] | None = None, text: str | list[int] | None = None,
             max_tokens: int = MAX_TOKENS) -> dict:
    """Request i's text, every token's logprob and its finish; streamed: put together
    from its chunks (a stream with an error, a gap or a repeat cannot equal the whole).
    Not streamed, its prompt's token count goes to `prompt_tokens[i]` if given. Its
    prompt is `text` if given (words or token ids), else prompt(i)."""
    sampled = {"temperature": 0.8, "seed": 1000 + i} if i % 4 >= 2 else {"temperature": 0}
    body = {"model": model, "prompt": prompt(i) if text is None else text,
            "max_tokens": max_tokens, **sampled,
            "logprobs": 1, "logit_bias": NO_EOS, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", timeout=180, json=body, headers=ALICE)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        if prompt_tokens is not None:
            prompt_tokens[i] = r.json()["usage"]["prompt_tokens"]
        return {"text": ch["text"], "logprobs": ch["logprobs"]["token_logprobs"],
                "finish": ch["finish_reason"]}
    out = {"text": "", "logprobs": [], "finish": None}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180,
                      headers=ALICE) as r:
        assert r.status_code == 200, r.read()
        for what, data in sse_lines(r):
            if what != "data" or data == "[DONE]":
                continue
            assert "error" not in data, data
            for ch in data["choices"]:
                out["text"] += ch.get("text") or ""
                out["logprobs"] += (ch.get("logprobs") or {}).get("token_logprobs") or []
                out["finish"] = ch.get("finish_reason") or out["finish"]
    return out


def flood(url: str, model: str, n: int | list[int], hold, **kw) -> dict[int, dict]:
    """Requests 0..n-1 (or those listed) at once: sent while rank 0 is held (`hold`), so
    all are in its queue together whatever the gateway took for each (rank 0 must make
    the head wait). `kw` goes to `complete`, as a function of i where callable."""
    out: dict[int, dict] = {}
    ids = list(range(n)) if isinstance(n, int) else n

    def one(i: int) -> None:
        try:
            args = {k: v(i) if callable(v) else v for k, v in kw.items()}
            out[i] = complete(url, model, i, stream=i % 2 == 1, **args)  # half streamed
        except BaseException as exc:  # noqa: BLE001 - reported below, not lost in a thread
            out[i] = {"error": repr(exc)}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in ids]
    with hold(len(ids)):
        for t in threads:
            t.start()
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a request never ended"
    return out


def rank_kv(c, dep_id: str) -> dict[int, dict]:
    dep = next(d for d in c.deployments() if d["deployment_id"] == dep_id)
    return {r["rank"]: r["kv"] for r in dep["ranks"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("kvb")
    opts = UpOptions(tp=2, extra=("--kv-budget-bytes", str(BUDGET)), env=KEYS)
    with up_cluster(home, opts) as c:
        deploy_tiny_pp_beside(c, home)
        yield c


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny", "tiny-pp"])
def test_a_flood_past_the_budget_completes_as_alone_and_no_rank_holds_more(cluster, model):
    c = cluster
    dep = next(d for d in c.deployments() if d["model"] == model and d["state"] == "serving")
    dep_id = dep["deployment_id"]
    n = 24
    prompt_tokens: dict[int, int] = {}
    alone = {i: complete(c.url, model, i, prompt_tokens=prompt_tokens) for i in range(n)}
    got = flood(c.url, model, n, functools.partial(held_at_rank0, c.url, c.hdr, dep))
    for i in range(n):
        assert "error" not in got[i], got[i]
        assert got[i]["finish"] == "length" and len(got[i]["logprobs"]) == MAX_TOKENS, got[i]
        assert got[i] == alone[i], f"request {i} differs from its run alone"

    def settled() -> dict[int, dict] | None:
        kv = rank_kv(c, dep_id)
        return kv if kv[0]["waits"] and all(k["held_peak"] for k in kv.values()) else None

    kv = poll_until(settled, 30, "rank 0's waits, every rank's peak")
    slot = kv[0]["slot_bytes"]
    assert slot > 0 and all(k["budget"] == BUDGET for k in kv.values()), kv
    # the flood's rows at once would need more than four budgets
    longest = max(prompt_tokens.values()) + MAX_TOKENS
    assert n * (longest + 1 + 256) * slot > 4 * BUDGET, (n, longest, slot)
    for rank, k in kv.items():
        assert k["held_peak"] <= BUDGET, (rank, k)
        assert k["held_peak"] > BUDGET / 4, (rank, k)  # the budget did bind the batch
    assert kv[0]["refused"] == 0
    # Whether the flood's rows outgrow the budget depends on which of them rank 0 runs
    # together (their arrival order, how many a plan admits): under load some runs needed
    # no preemption at all (PP=2: 2 in 17, TP=2: 1 in 17). So a preemption is proven on
    # two requests that must have one, whatever the order: prompts of P token ids, where
    # two rows of P fit with room for GAP more tokens each and one alone runs to P + GAP +
    # GROW. Both are in rank 0's queue at once, so the second is admitted while the first
    # is shorter than P + GAP (a later plan only if the prefill gate holds it, GAP steps
    # at most); as the first passes P + GAP the two no longer fit and one is preempted.
    before = kv[0]["preemptions"]
    gap, grow = 60, 100
    p = BUDGET // (2 * slot) - 1 - GROWTH - gap  # two rows of p + gap: need <= BUDGET
    assert 2 * (p + gap + 1 + GROWTH) * slot <= BUDGET < 2 * (p + gap + 2 + GROWTH) * slot
    assert (p + gap + grow + 1 + GROWTH) * slot <= BUDGET  # one alone runs to its end
    pair = {i: [3 + (7 * i + 13 * k) % 1100 for k in range(p)] for i in (0, 3)}
    n_prompt: dict[int, int] = {}
    alone = {i: complete(c.url, model, i, prompt_tokens=n_prompt, text=pair[i],
                         max_tokens=gap + grow) for i in pair}
    assert n_prompt == {0: p, 3: p}, n_prompt  # token ids go in as they are
    got = flood(c.url, model, list(pair), functools.partial(held_at_rank0, c.url, c.hdr, dep),
                text=pair.__getitem__, max_tokens=gap + grow)
    for i in pair:
        assert "error" not in got[i], got[i]
        assert got[i] == alone[i], f"pair request {i} differs from its run alone"
    poll_until(lambda: rank_kv(c, dep_id)[0]["preemptions"] > before, 10,
               "rank 0's preemption of one of the pair")


@pytest.mark.timeout(300)
def test_a_prompt_that_cannot_fit_alone_is_refused_naming_the_budget(cluster):
    c = cluster
    long = " ".join(["river", "mill", "lantern"][k % 3] for k in range(1200))
    r = httpx.post(c.url + "/v1/completions", timeout=60, headers=ALICE,
                   json={"model": "tiny", "prompt": long, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_budget_exceeded" and f"KV budget of {BUDGET} bytes" in err["message"]
    r = httpx.post(c.url + "/v1/messages", timeout=60, headers={"x-api-key": "kb"}, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert f"KV budget of {BUDGET} bytes" in r.json()["error"]["message"]
    # the service keeps serving
    assert complete(c.url, "tiny", 1)["finish"] == "length"


def test_status_banner_and_metrics_show_the_budget(cluster):
    c = cluster
    assert "KV budget:       1.9 MiB per rank" in c.text()
    metrics = httpx.get(c.url + "/metrics", timeout=10).text
    budgets = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("lockstep_rank_kv_budget{")]
    assert budgets == [BUDGET] * 4, budgets  # two deployments of two ranks
    st = httpx.get(c.url + "/admin/api/cluster/status", headers=c.hdr, timeout=10).json()
    assert {r["kv"]["budget"] for d in st["deployments"] for r in d["ranks"]} == {BUDGET}


def post(url: str, body: dict, out: dict, key, headers: dict | None = None) -> None:
    """One completion into out[key]: (the rank's request id, when it ended, status)."""
    try:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers or ALICE,
                       timeout=240)
        out[key] = (r.headers.get("x-lockstep-request-id"), time.monotonic(), r.status_code)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        out[key] = (None, time.monotonic(), repr(exc))


@pytest.mark.timeout(600)
def test_high_priority_requests_pass_a_waiting_low_priority_flood(cluster):
    """32 low-priority requests (priority 10, twice the batch of 16; the budget lets about
    three run at once), then, once rank 0 has started some, 4 short ones at priority -5
    (two through the body, two through the x-lockstep-priority header), sent while rank 0
    is held so they reach its queue together. From rank 0's own removal record (uid =
    insertion order, the same on every rank): no low-priority request was first inserted
    between the short ones, at least 10 were first inserted after them (they were waiting
    and were passed), and every short one ended before the flood did."""
    c = cluster
    dep = next(d for d in c.deployments() if d["model"] == "tiny" and d["state"] == "serving")
    dep_id = dep["deployment_id"]
    out: dict = {}
    low = [threading.Thread(target=post, args=(c.url, {
        "model": "tiny", "prompt": prompt(i), "max_tokens": 40, "temperature": 0,
        "logit_bias": NO_EOS, "priority": 10}, out, ("low", i)), daemon=True)
        for i in range(32)]
    for t in low:
        t.start()
    poll_until(lambda: len(removals(c, dep_id)) >= 2, 60, "rank 0 to finish a first request")

    def queued() -> bool:  # /metrics shows the flood waiting, by priority and by key
        m = httpx.get(c.url + "/metrics", timeout=10).text
        return (f'lockstep_rank0_queued_by_priority{{deployment="{dep_id}",priority="10"}}' in m
                and f'lockstep_rank0_queued_by_tenant{{deployment="{dep_id}",tenant="alice"}}'
                in m)
    poll_until(queued, 30, "the waiting flood in /metrics")
    short = [threading.Thread(target=post, args=(c.url, {
        "model": "tiny", "prompt": f"quick question {i}", "max_tokens": 4, "temperature": 0,
        "logit_bias": NO_EOS, **({"priority": -5} if i < 2 else {})}, out, ("short", i),
        ALICE if i < 2 else {**ALICE, "x-lockstep-priority": "-5"}), daemon=True)
        for i in range(4)]
    with held_at_rank0(c.url, c.hdr, dep, 4):
        for t in short:
            t.start()
    for t in [*low, *short]:
        t.join(300)
        assert not t.is_alive(), "a request never ended"
    assert all(v[2] == 200 for v in out.values()), out
    first: dict[str, int] = {}  # request id -> the uid of its first insertion
    for rec in removals(c, dep_id):
        first[rec["request_id"]] = min(first.get(rec["request_id"], rec["uid"]), rec["uid"])
    shorts = sorted(first[out[("short", i)][0]] for i in range(4))
    lows = [first[out[("low", i)][0]] for i in range(32)]
    between = [u for u in lows if shorts[0] < u < shorts[-1]]
    assert not between, (shorts, sorted(lows))
    assert sum(u > shorts[-1] for u in lows) >= 10, (shorts, sorted(lows))
    assert max(out[("short", i)][1] for i in range(4)) < max(
        out[("low", i)][1] for i in range(32))


def removals(c, dep_id: str) -> list[dict]:
    return read_removals(removals_path(Paths(c.home), dep_id, 0))


@pytest.mark.parametrize(("headers", "body", "what"), [
    ({"x-lockstep-priority": "soon"}, {}, "an integer is expected"),
    ({"x-lockstep-priority": str(1 << 21)}, {}, "priority must be an integer in"),
    ({}, {"priority": 1.5}, "priority"),
])
def test_a_priority_out_of_range_is_a_400_naming_it(cluster, headers, body, what):
    r = httpx.post(cluster.url + "/v1/completions", headers={**ALICE, **headers}, timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and what in err["message"], err


def test_a_key_past_its_highest_priority_is_a_400(cluster):
    r = httpx.post(cluster.url + "/v1/completions", headers=CAROL, timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": -1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "its highest is 0" in err["message"], err


@pytest.mark.timeout(600)
def test_keys_take_turns_while_one_floods(cluster):
    """alice floods 24 requests; once rank 0 has finished some, bob sends 4 (rank 0 held
    while they are sent, so they reach its queue together). rank 0's removal record (uid =
    insertion order): bob's requests were inserted in turn with alice's waiting ones (at
    most 4 of alice's between bob's first and last), not after them (at least 8 of
    alice's came after). Then carol, whose share of the in-flight bound is 4, sends 5 while
    rank 0 is held: exactly one gets a 429 tenant_share_exceeded with retry-after."""
    c = cluster
    dep = next(d for d in c.deployments() if d["model"] == "tiny" and d["state"] == "serving")
    dep_id = dep["deployment_id"]
    out: dict = {}

    def body(i: int, n: int = 30) -> dict:
        return {"model": "tiny", "prompt": prompt(i), "max_tokens": n, "temperature": 0,
                "logit_bias": NO_EOS}

    before = len(removals(c, dep_id))
    flood = [threading.Thread(target=post, args=(c.url, body(i), out, ("alice", i), ALICE),
                              daemon=True) for i in range(24)]
    for t in flood:
        t.start()
    poll_until(lambda: len(removals(c, dep_id)) >= before + 2, 60, "alice's first requests")
    bob = [threading.Thread(target=post, args=(c.url, body(i), out, ("bob", i), BOB),
                            daemon=True) for i in range(4)]
    with held_at_rank0(c.url, c.hdr, dep, 4):
        for t in bob:
            t.start()
    for t in [*flood, *bob]:
        t.join(300)
        assert not t.is_alive(), "a request never ended"
    assert all(v[2] == 200 for v in out.values()), out
    first: dict[str, int] = {}
    for rec in removals(c, dep_id):
        first[rec["request_id"]] = min(first.get(rec["request_id"], rec["uid"]), rec["uid"])
    b = sorted(first[out[("bob", i)][0]] for i in range(4))
    a = [first[out[("alice", i)][0]] for i in range(24)]
    assert sum(b[0] < u < b[-1] for u in a) <= 4, (b, sorted(a))
    assert sum(u > b[-1] for u in a) >= 8, (b, sorted(a))

    carol: dict = {}
    threads = [threading.Thread(target=post, args=(c.url, body(i, 2), carol, i, CAROL),
                                daemon=True) for i in range(5)]
    pid = next(r["pid"] for r in dep["ranks"] if r["rank"] == 0)
    with rank0_frozen(pid):
        for t in threads:
            t.start()
        poll_until(lambda: [v[2] for v in carol.values()] == [429], FREEZE_S,
                   "the fifth of carol's requests refused past her share")
    for t in threads:
        t.join(120)
    assert sorted(v[2] for v in carol.values()) == [200] * 4 + [429], carol
