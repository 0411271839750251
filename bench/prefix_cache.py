"""Prefix-cache benchmark (issue 14 item 6): Lockstep with its prompt cache on, off, and
`mlx_lm.server` (its LRU prompt cache on, at its default size) on the same model
directory in the same run, with the same BLAS and batch settings (bench/servers.py).

(a) conversation: one chat of `turns` turns; each turn adds ~`new_tokens` tokens of
    distinct text (bench/workload.py) plus the previous reply (the server's own,
    greedy, max_tokens 24) and the whole conversation is sent again, as a chat client
    does. TTFT of every turn, `runs` conversations per system, each with its own text
    (a run never hits a previous run's entries); medians per turn, ratios of medians.
(b) shared system prompt: `shared_requests` requests with one ~`system_tokens`-token
    system prompt and distinct user messages, `shared_concurrency` in flight; TTFT p50.
(c) the same for Lockstep at TP=2 (cache on vs off).

The issue's targets are computed from the numbers and written with them, never assumed.

    python -m bench.prefix_cache [--quick] [--runs 3] [--tp 1,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import RESULTS, write_result
from bench import servers as sv
from bench.chat_client import CLIENT, chat, run_concurrent, summarize
from bench.gateway import MODEL_CACHE
from bench.workload import load_tokenizer, log_uniform_lengths, prose


@dataclass
class Config:
    preset: str = "bench"
    turns: int = 8
    new_tokens: int = 250
    max_tokens: int = 24
    runs: int = 3
    shared_requests: int = 16
    system_tokens: int = 1500
    user_tokens: tuple[int, int] = (40, 160)
    shared_concurrency: int = 4
    shared_runs: int = 1
    tps: tuple[int, ...] = (1, 2)
    tp2_runs: int = 1  # conversations per system at TP=2 (c)
    seed: str = "pc-1"


QUICK = Config(preset="tiny", turns=4, runs=1, shared_requests=8, system_tokens=600)


async def conversation(srv: sv.Server, tok, cfg: Config, run: int) -> list[dict]:
    messages: list[dict] = []
    turns = []
    for t in range(cfg.turns):
        messages.append({"role": "user",
                         "content": prose(tok, cfg.new_tokens, f"{cfg.seed}/conv/r{run}/t{t}")})
        r = await chat(srv.url, srv.model, messages, cfg.max_tokens)
        messages.append({"role": "assistant", "content": r.text})
        rec = r.record()
        if rec["ttft_ms"] is None:  # an empty reply (EOS first): prefill ends with it
            rec["ttft_ms"], rec["no_content"] = rec["total_ms"], True
        turns.append(rec)
    return turns


def shared_prompt(srv: sv.Server, tok, cfg: Config, run: int) -> dict:
    key = f"{cfg.seed}/shared/r{run}"
    system = prose(tok, cfg.system_tokens, key)
    lengths = log_uniform_lengths(cfg.shared_requests, *cfg.user_tokens, key)
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": prose(tok, n, f"{key}/u{i}")}]
             for i, n in enumerate(lengths)]
    replies, secs = asyncio.run(run_concurrent(srv.url, srv.model, convs, cfg.max_tokens,
                                               cfg.shared_concurrency))
    out = summarize(replies, secs)
    out["requests_detail"] = [r.record() for r in replies]
    return out


def warm(srv: sv.Server, tok) -> None:
    convs = [[{"role": "user", "content": prose(tok, 200, f"warm/{i}")}] for i in range(2)]
    asyncio.run(run_concurrent(srv.url, srv.model, convs, 8, 2))


def measure_system(srv: sv.Server, tok, cfg: Config, runs: int) -> dict:
    warm(srv, tok)
    convs = []
    for k in range(runs):
        convs.append(asyncio.run(conversation(srv, tok, cfg, k)))
        print(f"  {srv.name:22s} conversation run {k}: ttft ms "
              f"{[t['ttft_ms'] for t in convs[-1]]}", flush=True)
    shared = []
    for k in range(cfg.shared_runs):
        shared.append(shared_prompt(srv, tok, cfg, k))
        print(f"  {srv.name:22s} shared system prompt run {k}: ttft p50 "
              f"{shared[-1]['ttft_p50_ms']} ms", flush=True)
    per_turn = [statistics.median(c[t]["ttft_ms"] for c in convs) for t in range(cfg.turns)]
    return {"conversation": {"runs": convs, "ttft_median_ms": [round(x, 2) for x in per_turn],
                             "turn_last_vs_first": round(per_turn[-1] / per_turn[0], 3)},
            "shared_system_prompt": {
                "runs": shared,
                "ttft_p50_ms": statistics.median(s["ttft_p50_ms"] for s in shared)},
            "loadavg": os.getloadavg()[0]}


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [round(x / y, 3) for x, y in zip(a, b, strict=True)]


def compare(systems: dict, on: str, off: str, ref: str | None) -> dict:
    s_on, s_off = systems[on], systems[off]
    on_t, off_t = s_on["conversation"]["ttft_median_ms"], s_off["conversation"]["ttft_median_ms"]
    out = {"conversation_ttft_on_vs_off_per_turn": _ratios(on_t, off_t),
           "shared_ttft_p50_on_vs_off": round(s_on["shared_system_prompt"]["ttft_p50_ms"]
                                              / s_off["shared_system_prompt"]["ttft_p50_ms"], 3)}
    if ref is not None:
        ref_t = systems[ref]["conversation"]["ttft_median_ms"]
        out["conversation_ttft_on_vs_mlx_lm_per_turn"] = _ratios(on_t, ref_t)
        out["shared_ttft_p50_on_vs_mlx_lm"] = round(
            s_on["shared_system_prompt"]["ttft_p50_ms"]
            / systems[ref]["shared_system_prompt"]["ttft_p50_ms"], 3)
    return out


def targets(tp_results: dict) -> dict:
    """Issue 14 item 6, computed. Turn numbers are 1-based as in the issue."""
    out = {}
    if "tp1" in tp_results:
        r, sys1 = tp_results["tp1"]["ratios"], tp_results["tp1"]["systems"]
        vs = r["conversation_ttft_on_vs_mlx_lm_per_turn"][1:]
        out["turns_2_8_ttft_vs_mlx_lm"] = {
            "target": "<= 1.0 on every turn 2..N (Lockstep cache on / mlx_lm.server, "
                      "ratio of medians over runs)",
            "value": vs, "worst": max(vs), "met": all(v <= 1.0 for v in vs)}
        last = sys1["lockstep-tp1-cache-on"]["conversation"]["turn_last_vs_first"]
        out["turn_last_vs_first"] = {"target": "<= 2.0 (Lockstep cache on)", "value": last,
                                     "met": last <= 2.0}
        sh = r["shared_ttft_p50_on_vs_off"]
        out["shared_ttft_p50_on_vs_off"] = {"target": "<= 0.3", "value": sh, "met": sh <= 0.3}
    if "tp2" in tp_results:
        r, sys2 = tp_results["tp2"]["ratios"], tp_results["tp2"]["systems"]
        last = sys2["lockstep-tp2-cache-on"]["conversation"]["turn_last_vs_first"]
        sh = r["shared_ttft_p50_on_vs_off"]
        out["tp2_same_shape"] = {
            "target": "TP=2: turn N <= 2x turn 1 and shared p50 on <= 0.3x off",
            "value": {"turn_last_vs_first": last, "shared_ttft_p50_on_vs_off": sh},
            "met": last <= 2.0 and sh <= 0.3}
    return out


WORKLOAD_KEYS = ("preset", "turns", "new_tokens", "max_tokens", "shared_requests",
                 "system_tokens", "user_tokens", "shared_concurrency", "shared_runs", "seed")


def _merge_into(result: dict, path: Path, cfg: Config) -> None:
    base = json.loads(path.read_text())
    mine = asdict(cfg)
    differ = {k: (base["config"].get(k), mine[k]) for k in WORKLOAD_KEYS
              if base["config"].get(k) != (list(mine[k]) if isinstance(mine[k], tuple) else mine[k])}
    if differ:
        raise SystemExit(f"--merge: {path} was measured with another workload: {differ}")
    keep = {k: v for k, v in base["tp"].items() if k not in {f"tp{t}" for t in cfg.tps}}
    result["tp"].update(keep)
    result["servers"] = [s for s in base["servers"]
                         if any(s["name"].startswith(f"lockstep-{k}") for k in keep)
                         or (s["name"].startswith("mlx_lm") and "tp1" in keep)]
    result["merged"] = {"from_started": base["started"], "kept": sorted(keep),
                        "their_environment": base["environment"]}


def run(out_dir: Path | str | None = None, cfg: Config | None = None,
        merge: bool = False) -> dict:
    """Measure every TP size in cfg.tps; with `merge`, keep the other TP sizes' results
    of the existing prefix_cache.json (same preset and workload) and add these."""
    from models.tinymodel import build_model

    cfg = cfg or Config()
    model = build_model(MODEL_CACHE / cfg.preset, preset=cfg.preset)
    tok = load_tokenizer(model)
    result = {"benchmark": "prefix_cache", "host": platform.node(),
              "python": platform.python_version(), "started": time.time(),
              "config": asdict(cfg), "model": str(model), "client": CLIENT,
              "environment": sv.environment_record(), "servers": [], "tp": {}}
    out = out_dir if out_dir is not None else RESULTS
    if merge:
        _merge_into(result, Path(out) / "prefix_cache.json", cfg)
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-pc-") as tmp:
        work = Path(tmp)
        for tp in cfg.tps:
            runs = cfg.runs if tp == 1 else cfg.tp2_runs
            starts = [(lambda tp=tp: sv.lockstep(model, work, tp, True)),
                      (lambda tp=tp: sv.lockstep(model, work, tp, False))]
            if tp == 1:
                starts.append(lambda: sv.mlx_lm(model, work, True))
            systems: dict = {}
            started = time.time()
            result["tp"][f"tp{tp}"] = {"runs": runs, "started": started, "systems": systems}
            for start in starts:
                srv = start()
                try:
                    systems[srv.name] = measure_system(srv, tok, cfg, runs)
                finally:
                    sv.stop(srv)
                    result["servers"].append(srv.record())
                # Written after every server: a run cut short still leaves what it measured.
                write_result(out, "prefix_cache", {**result, "complete": False})
            ratios = compare(systems, f"lockstep-tp{tp}-cache-on", f"lockstep-tp{tp}-cache-off",
                             "mlx_lm-cache-on" if tp == 1 else None)
            result["tp"][f"tp{tp}"] = {"runs": runs, "started": started, "systems": systems,
                                       "ratios": ratios}
    result["targets"] = targets(result["tp"])
    result["summary"] = {
        tp: {"ttft_median_ms": {n: s["conversation"]["ttft_median_ms"]
                                for n, s in r["systems"].items()},
             "shared_ttft_p50_ms": {n: s["shared_system_prompt"]["ttft_p50_ms"]
                                    for n, s in r["systems"].items()},
             # What each server said it reused (usage.prompt_tokens_details), first run.
             "cached_tokens_per_turn_run0": {
                 n: [t["cached_tokens"] for t in s["conversation"]["runs"][0]]
                 for n, s in r["systems"].items()},
             "prompt_tokens_per_turn_run0": {
                 n: [t["prompt_tokens"] for t in s["conversation"]["runs"][0]]
                 for n, s in r["systems"].items()},
             **r["ratios"]}
        for tp, r in result["tp"].items()}
    result["complete"] = True
    result["seconds"] = round(time.time() - result["started"], 1)
    result["loadavg_end"] = os.getloadavg()
    write_result(out, "prefix_cache", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke on the tiny preset")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--tp2-runs", type=int)
    ap.add_argument("--tp", help="comma-separated Lockstep TP sizes (default: 1,2)")
    ap.add_argument("--merge", action="store_true",
                    help="add to the existing prefix_cache.json's other TP sizes")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else Config()
    if a.runs:
        cfg.runs = a.runs
    if a.tp2_runs:
        cfg.tp2_runs = a.tp2_runs
    if a.tp:
        cfg.tps = tuple(int(t) for t in a.tp.split(","))
    out = a.out
    if a.quick and out is None:  # a smoke never overwrites the committed result
        out = Path(tempfile.gettempdir()) / "lockstep-bench-quick"
    res = run(out, cfg, a.merge)
    print(json.dumps(res["summary"], indent=1))
    print(json.dumps(res["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
