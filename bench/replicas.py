"""Replicas (issue 31), ratios within one run, tiny preset, TP=1 replicas on this host:

1. throughput: 2 replicas vs 1 on DISTINCT prompts (~770 tokens each) at concurrency 16:
   output tokens/s and TTFT p50/p99 (streamed, at the client);
2. an agent workload: CONVS conversations x TURNS turns sharing a ~2k-token system
   prompt, all conversations at once, each turn sent when the previous one answered:
   per turn, the share of prompt tokens served from the prefix cache (the gateway's
   `cached_tokens`) and the median TTFT — cache-aware routing (approximate index, and
   the precise one: rank 0's cache events) vs round-robin;
3. failover: SIGKILL of rank 0 of the deployment a few streams run on, to the next token
   at the client: with a second replica serving (resumed there at once) vs with one
   (resumed once `up` has redeployed it).

Each configuration gets its own `lockstep up` (own home, free ports; settings through
LOCKSTEP_ROUTE_POLICY / LOCKSTEP_ROUTE_INDEX), every setting written in the JSON. On a
2-core machine two replicas share the same two cores: the throughput ratio says what a
second replica adds here (bounded by the cores, not by the router).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import httpx

from bench.servers import environment_record, free_port

REPO = Path(__file__).resolve().parents[1]
NO_EOS = {"0": -100, "2": -100}  # the tiny preset's EOS ids: every answer runs to max_tokens
WORDS = ("amber birch cedar delta ember fjord grove heath inlet juniper kestrel lagoon "
         "meadow nectar orchid prairie quarry river summit tundra upland valley willow "
         "xenon yarrow zephyr").split()
CONCURRENCY, DISTINCT, OUT_TOKENS = 16, 32, 64
CONVS, TURNS, TURN_TOKENS = 16, 6, 24
FAILOVER_TRIALS, FAILOVER_STREAMS = 3, 3
FAILOVER_TOKENS = 1500  # a stream alone makes ~250 tokens/s here: still running at the kill


def _words(seed: int, n: int) -> str:
    x, out = seed * 7919 + 17, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


class Up:
    def __init__(self, tmp: Path, name: str, model: Path, replicas: int, *,
                 restarts: int = FAILOVER_TRIALS + 2, args: tuple[str, ...] = (),
                 **env: str) -> None:
        self.home, self.out = tmp / f"home-{name}", tmp / f"up-{name}.out"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.settings = {"replicas": replicas, "tp": 1, **env}
        argv = [sys.executable, "-m", "services", "up", "--home", str(self.home),
                "--port", str(port), "--admin-port", "0", "--events-port", "0",
                "--control-port", "0", "--report-port", "0", "--reaper-events-port", "0",
                "--model", str(model), "--tp", "1", "--replicas", str(replicas),
                "--restarts", str(restarts), *args]
        self._log = open(self.out, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **env})
        t0 = time.monotonic()
        while "Press Ctrl-C" not in self.out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() - t0 > 600:
                self.stop()
                raise RuntimeError(f"up did not serve: {self.out.read_text()[-2000:]}")
            time.sleep(0.1)
        token = (self.home / "admin.token").read_text().strip()
        self.hdr = {"Authorization": f"Bearer {token}"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def status(self) -> dict:
        return httpx.get(self.url + "/admin/api/cluster/status", headers=self.hdr,
                         timeout=10).json()["gateway"]

    def serving(self) -> list[dict]:
        deps = httpx.get(self.url + "/admin/api/cluster/deployments", headers=self.hdr,
                         timeout=10).json()["deployments"]
        return [d for d in deps if d["state"] == "serving"]

    def stream(self, messages: list[dict], max_tokens: int, *, seed: int = 0) -> dict:
        """One streamed chat: TTFT, token arrival times, usage, where it ran."""
        body = {"model": "tiny", "messages": messages, "stream": True, "temperature": 0,
                "max_tokens": max_tokens, "logit_bias": NO_EOS, "seed": seed,
                "stream_options": {"include_usage": True}}
        t0 = time.time()  # wall clock: compared with the gateway's resume record
        times, text, usage = [], [], None
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                          timeout=300) as r:
            r.raise_for_status()
            where = r.headers.get("x-lockstep-deployment")
            rid = r.headers.get("x-lockstep-request-id")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk["choices"]:
                    if ch["delta"].get("content"):
                        times.append(time.time())
                        text.append(ch["delta"]["content"])
        return {"ttft": times[0] - t0 if times else None, "times": times, "text": "".join(text),
                "usage": usage, "where": where, "rid": rid, "t0": t0}


def _pool(n: int, fn, jobs: list) -> list:
    out: list = [None] * len(jobs)
    it = iter(enumerate(jobs))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            i, job = nxt
            out[i] = fn(job)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def throughput(up: Up) -> dict:
    prompts = [[{"role": "user", "content": f"request {i}: " + _words(i, 220)}]
               for i in range(DISTINCT)]
    t0 = time.monotonic()
    res = _pool(CONCURRENCY, lambda m: up.stream(m, OUT_TOKENS), prompts)
    wall = time.monotonic() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in res)
    ttfts = [r["ttft"] for r in res]
    where: dict[str, int] = {}
    for r in res:
        where[r["where"]] = where.get(r["where"], 0) + 1
    return {"requests": len(res), "prompt_tokens_mean": round(
        sum(r["usage"]["prompt_tokens"] for r in res) / len(res), 1),
        "output_tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 3), "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99), "split": sorted(where.values())}


def agent(up: Up) -> dict:
    system = {"role": "system", "content": "You are a careful agent. " + _words(999, 570)}
    per_turn: list[list[dict]] = [[] for _ in range(TURNS)]
    lock = threading.Lock()

    def conversation(c: int) -> None:
        msgs = [system]
        for t in range(TURNS):
            msgs.append({"role": "user", "content": f"conversation {c} turn {t}: "
                         + _words(c * 100 + t, 40)})
            r = up.stream(msgs, TURN_TOKENS)
            with lock:
                per_turn[t].append(r)
            msgs.append({"role": "assistant", "content": r["text"]})

    threads = [threading.Thread(target=conversation, args=(c,), daemon=True)
               for c in range(CONVS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    turns = []
    for t, rs in enumerate(per_turn):
        prompt = sum(r["usage"]["prompt_tokens"] for r in rs)
        cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for r in rs)
        turns.append({"turn": t + 1, "requests": len(rs), "cached_share": round(cached / prompt, 4),
                      "ttft_median_s": round(median(r["ttft"] for r in rs), 4)})
    rs = [r for t in per_turn for r in t]
    total_prompt = sum(r["usage"]["prompt_tokens"] for r in rs)
    total_cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                       for r in rs)
    later = [r for t in per_turn[1:] for r in t]
    return {"turns": turns, "cached_share": round(total_cached / total_prompt, 4),
            "cached_share_turns_2_on": round(
                sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    for r in later) / sum(r["usage"]["prompt_tokens"] for r in later), 4),
            "ttft_median_s": round(median(r["ttft"] for r in rs), 4),
            "ttft_median_turns_2_on_s": round(median(r["ttft"] for r in later), 4)}


def failover(up: Up) -> dict:
    """kill → next token, per trial the median over the streams on the killed deployment."""
    trials = []
    for trial in range(FAILOVER_TRIALS):
        deadline = time.monotonic() + 300
        while len(up.serving()) < up.settings["replicas"]:  # every replica back first
            if time.monotonic() > deadline:
                raise RuntimeError("replicas not back")
            time.sleep(0.5)
        got: dict[int, dict] = {}

        def one(i: int, trial: int = trial, got: dict = got) -> None:
            msgs = [{"role": "user", "content": f"failover {trial} stream {i}"}]
            got[i] = up.stream(msgs, FAILOVER_TOKENS, seed=i)

        threads = [threading.Thread(target=one, args=(i,), daemon=True)
                   for i in range(FAILOVER_STREAMS)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every stream under way (tokens arriving), far from its end
        victim = up.serving()[0]
        seen = len(up.status()["recent_resumes"])
        killed_at = time.time()
        os.kill(victim["ranks"][0]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(600)
        resumed = {r["request_id"]: r for r in up.status()["recent_resumes"][seen:]}
        gaps, split = [], []
        for r in got.values():
            res = resumed.get(r["rid"])
            if res is None:
                continue  # on another replica, or finished before the kill
            nxt = next((x for x in r["times"] if x > res["at"]), None)
            if nxt is not None:  # the first token the continuation produced
                gaps.append(nxt - killed_at)
                split.append({"to_resumed_s": round(res["at"] - killed_at, 3),
                              "resumed_to_token_s": round(nxt - res["at"], 3)})
        trials.append({"streams_resumed": len(gaps), "split": split,
                       "kill_to_next_token_s": round(median(gaps), 3) if gaps else None})
    vals = [t["kill_to_next_token_s"] for t in trials if t["kill_to_next_token_s"] is not None]
    return {"trials": trials, "median_s": round(median(vals), 3) if vals else None}


def run(out_dir: Path | None = None) -> dict:
    from models.tinymodel import build_model

    result: dict = {"environment": environment_record(), "model": "tiny (random weights)",
                    "settings": {"concurrency": CONCURRENCY, "distinct_prompts": DISTINCT,
                                 "out_tokens": OUT_TOKENS, "conversations": CONVS,
                                 "turns": TURNS, "turn_tokens": TURN_TOKENS,
                                 "failover_trials": FAILOVER_TRIALS,
                                 "failover_streams": FAILOVER_STREAMS,
                                 "failover_tokens": FAILOVER_TOKENS,
                                 "prefix_cache": "on (defaults: 32 entries)"}}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as d:
        tmp = Path(d)
        model = build_model(tmp / "models" / "tiny", preset="tiny")
        runs = {"one": (1, {}), "two": (2, {}),
                "two_round_robin": (2, {"LOCKSTEP_ROUTE_POLICY": "round_robin"}),
                "two_precise": (2, {"LOCKSTEP_ROUTE_INDEX": "precise"})}
        for name, (replicas, env) in runs.items():
            up = Up(tmp, name, model, replicas, **env)
            try:
                part: dict = {"settings": up.settings}
                if name in ("one", "two"):
                    part["throughput"] = throughput(up)
                part["agent"] = agent(up)
                if name in ("one", "two"):
                    part["failover"] = failover(up)
                result[name] = part
            finally:
                up.stop()
    one, two = result["one"], result["two"]
    result["ratios"] = {
        "tokens_per_s_two_over_one": round(two["throughput"]["tokens_per_s"]
                                           / one["throughput"]["tokens_per_s"], 3),
        "ttft_p50_two_over_one": round(two["throughput"]["ttft_p50_s"]
                                       / one["throughput"]["ttft_p50_s"], 3),
        "agent_cached_share": {k: result[k]["agent"]["cached_share_turns_2_on"]
                               for k in ("two", "two_precise", "two_round_robin")},
        "agent_ttft_turns_2_on_cache_over_round_robin": round(
            two["agent"]["ttft_median_turns_2_on_s"]
            / result["two_round_robin"]["agent"]["ttft_median_turns_2_on_s"], 3),
        "failover_two_replicas_s": two["failover"]["median_s"],
        "failover_redeploy_s": one["failover"]["median_s"],
    }
    return result


if __name__ == "__main__":
    from bench import write_result

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "bench" / "results"
    write_result(out, "replicas", run(out))
