"""The KV budget, priorities and mlx_lm.server under a flood (issue 45), bench preset.

Three servers on the same model directory, rank environment and batch settings
(bench/servers.py), prefix caches off for all:

- `lockstep up --tp 2 --kv-budget-bytes 0` (unbounded) and `--kv-budget-bytes BUDGET`
  (binding: about a quarter of what the flood's rows would hold at once);
- `mlx_lm.server` (one process: it cannot bound KV; tp 1, which holds the whole model's
  KV in one process where Lockstep splits it over two ranks: its RSS is per process).

The flood: FLOOD streamed chat requests at once, each a distinct ~PROMPT-token prompt,
greedy, MAX_TOKENS tokens (EOS biased off, so every row runs to the end). Measured per
server: wall time, completion tokens/s, client TTFT p50/p99, errors, peak RSS of every
model process (sampled every 0.2 s), and for Lockstep every rank's own peak of KV held
(telemetry), rank 0's waits and preemptions; whether the budgeted run's texts equal the
unbounded run's (determinism is on in both).

Priorities, on the unbounded Lockstep (slots bind: 2 x 16 long requests): SHORTS short
requests sent 3 s into a low-priority flood, their TTFT p50/p99 with `priority: -1` and
without (all 0).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench import RESULTS, write_result
from bench import servers as sv
from bench.workload import load_tokenizer, prose

FLOOD, PROMPT, MAX_TOKENS = 24, 600, 96
BUDGET = 32 << 20
LOW, SHORTS = 32, 8
NO_EOS = {"0": -100, "2": -100}  # the presets' EOS ids


def chat(url: str, model: str, text: str, max_tokens: int, out: dict, key,
         priority: int | None = None) -> None:
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "logit_bias": NO_EOS, "messages": [{"role": "user", "content": text}]}
    if priority is not None:
        body["priority"] = priority
    t0 = time.monotonic()
    first, parts, err = None, [], None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
            if r.status_code != 200:
                err = f"{r.status_code} {r.read()[:200]!r}"
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        err = str(d["error"])[:200]
                        break
                    for ch in d.get("choices", []):
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.monotonic()
                            parts.append(piece)
    except Exception as exc:  # noqa: BLE001 - counted as what the client got
        err = repr(exc)[:200]
    out[key] = {"ttft": None if first is None else first - t0, "text": "".join(parts),
                "end": time.monotonic(), "error": err}


def sampler(srv: sv.Server, stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        for role, pid in srv.processes().items():
            if "rank" in role or "mlx_lm" in role:
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                peaks[role] = max(peaks.get(role, 0), rss)
        stop.wait(0.2)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def flood(srv: sv.Server, texts: list[str]) -> dict:
    out: dict = {}
    peaks: dict = {}
    stop = threading.Event()
    watch = threading.Thread(target=sampler, args=(srv, stop, peaks), daemon=True)
    watch.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=chat, args=(srv.url, srv.model, t, MAX_TOKENS, out, i),
                                daemon=True) for i, t in enumerate(texts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    wall = time.monotonic() - t0
    stop.set()
    watch.join(5)
    ok = [v for v in out.values() if v["error"] is None]
    return {"wall_s": round(wall, 2), "requests": len(texts), "errors": len(texts) - len(ok),
            "error_samples": sorted({v["error"] for v in out.values() if v["error"]})[:3],
            "completion_tokens_per_s": round(len(ok) * MAX_TOKENS / wall, 2),
            "ttft_p50_s": pct([v["ttft"] for v in ok], 0.5),
            "ttft_p99_s": pct([v["ttft"] for v in ok], 0.99),
            "peak_rss_bytes": peaks, "loadavg": os.getloadavg(),
            "texts": {i: out[i]["text"] for i in sorted(out)}}


def lockstep_kv(srv: sv.Server) -> dict:
    st = httpx.get(srv.url + "/admin/api/cluster/deployments",
                   headers={"authorization": "Bearer " + admin_token(srv)}, timeout=10).json()
    dep = st["deployments"][0]
    return {str(r["rank"]): r.get("kv") for r in dep["ranks"]}


def admin_token(srv: sv.Server) -> str:
    home = Path(srv.settings["cmd"][srv.settings["cmd"].index("--home") + 1])
    return (home / "admin.token").read_text().strip()


def priorities(srv: sv.Server, tok, use: bool) -> dict:
    out: dict = {}
    low = [threading.Thread(target=chat, args=(
        srv.url, srv.model, prose(tok, PROMPT, f"kvb/low/{i}"), MAX_TOKENS, out, ("low", i),
        1 if use else None), daemon=True) for i in range(LOW)]
    for t in low:
        t.start()
    time.sleep(3.0)  # the flood running and waiting: the shorts arrive into it
    short = [threading.Thread(target=chat, args=(
        srv.url, srv.model, prose(tok, 60, f"kvb/short/{i}"), 8, out, ("short", i),
        -1 if use else None), daemon=True) for i in range(SHORTS)]
    for t in short:
        t.start()
    for t in [*low, *short]:
        t.join(1800)
    ttft = [out[("short", i)]["ttft"] for i in range(SHORTS)]
    low_end = max(out[("low", i)]["end"] for i in range(LOW))
    return {"priorities": use, "short_ttft_p50_s": pct(ttft, 0.5),
            "short_ttft_p99_s": pct(ttft, 0.99),
            "shorts_done_before_flood": sum(out[("short", i)]["end"] < low_end
                                            for i in range(SHORTS)),
            "errors": sum(v["error"] is not None for v in out.values())}


def run(out_dir=None) -> dict:
    out = out_dir if out_dir is not None else RESULTS
    work = Path(tempfile.mkdtemp(prefix="lockstep-kvb-"))
    from models.tinymodel import build_model

    model = build_model(work / "models" / "bench", preset="bench")
    tok = load_tokenizer(model)
    texts = [prose(tok, PROMPT, f"kvb/flood/{i}") for i in range(FLOOD)]
    result: dict = {"benchmark": "kv_budget", "environment": sv.environment_record(),
                    "config": {"flood": FLOOD, "prompt_tokens": PROMPT,
                               "max_tokens": MAX_TOKENS, "budget_bytes": BUDGET,
                               "prefix_cache": False, "model": "bench preset",
                               "low_flood": LOW, "shorts": SHORTS},
                    "servers": {}, "runs": {}}
    for name, extra in (("lockstep_unbounded", ("--kv-budget-bytes", "0")),
                        ("lockstep_budget", ("--kv-budget-bytes", str(BUDGET)))):
        srv = sv.lockstep(model, work, 2, cache=False, extra=extra, tag=f"-{name}")
        try:
            result["servers"][name] = srv.record()
            run_ = flood(srv, texts)
            run_["rank_kv"] = lockstep_kv(srv)
            result["runs"][name] = run_
            if name == "lockstep_unbounded":
                result["runs"]["priorities_off"] = priorities(srv, tok, False)
                result["runs"]["priorities_on"] = priorities(srv, tok, True)
        finally:
            sv.stop(srv)
        write_result(out, "kv_budget", result)
    srv = sv.mlx_lm(model, work, cache=False)
    try:
        result["servers"]["mlx_lm"] = srv.record()
        result["runs"]["mlx_lm"] = flood(srv, texts)
    finally:
        sv.stop(srv)
    a, b = result["runs"]["lockstep_unbounded"], result["runs"]["lockstep_budget"]
    result["budget_texts_equal_unbounded"] = a["texts"] == b["texts"]
    result["ratios"] = {
        "budget_vs_unbounded_tokens_per_s": round(
            b["completion_tokens_per_s"] / a["completion_tokens_per_s"], 3),
        "mlx_lm_vs_lockstep_unbounded_tokens_per_s": round(
            result["runs"]["mlx_lm"]["completion_tokens_per_s"] / a["completion_tokens_per_s"], 3)}
    for r in result["runs"].values():
        r.pop("texts", None)
    write_result(out, "kv_budget", result)
    return result


if __name__ == "__main__":
    run()
