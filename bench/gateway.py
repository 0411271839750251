"""Gateway benchmark: Lockstep end to end vs `mlx_lm.server` vs rank 0's batch loop
in-process, on distinct chat prompts of realistic length, like with like.

- lockstep_tp1 / lockstep_tp2: `lockstep up --tp N` (bench/servers.py), streaming
  /v1/chat/completions; TP=2 is Lockstep only (mlx_lm.server is one process).
- mlx_lm: `python -m mlx_lm server` on the same model directory, with the environment a
  rank gets (same OpenBLAS preload, OPENBLAS_NUM_THREADS, MLX buffer limits — checked on
  the running processes, the run fails otherwise) and --decode-concurrency /
  --prompt-concurrency / --prefill-step-size = RankSettings max_batch / prefill_batch /
  prefill_step; started through bench/mlx_lm_serve.py, which only gives it the
  gateway's listen backlog (with socketserver's 5, 32 connections at once get resets).
- inproc: `services.rank.engine.Engine` fed the same chat-templated token ids in a
  subprocess with the rank environment — the ceiling the serving stack is held to.

Rows: prefix caches OFF for both servers (`--prompt-cache-entries 0` /
`--prompt-cache-size 0`), then both ON (each at its default size). Workload: for each
concurrency C, N(C) distinct prompts (bench/workload.py: lengths log-uniform in the
preset's token range, counted with the model's tokenizer, distinct text per trial and
concurrency, the same for every system), C requests in flight at all times, greedy,
fixed max_tokens. Reported per measurement: generated tokens/s, TTFT p50/p90, ITL
p50/p99 (client-side, bench/chat_client.py); Lockstep's `rank_phase_us_per_token`, each
rank's wall time per loop phase (services/rank/phase_clock.py, from the gateway's
`lockstep_rank_phase_seconds_total`) per completion token; `wall_ms_per_token` and `cpu_us_per_token`,
the CPU of every process of the system (Lockstep: up, supervisor, reaper, gateway, each
rank; mlx_lm.server; the in-process loop; the bench client apart), user/system and per
OS thread, read with psutil before and after (bench/cpu_breakdown.py); medians over
trials in `summary`, where `breakdown` has the per-process view per system; ratios in
the same run; the issue-16 targets computed, never asserted.

    python -m bench.gateway [--quick] [--presets bench,tiny] [--concurrency 1,8,32]
        [--tp 1,2] [--caches off,on] [--on-concurrency 8] [--requests 1:4,8:16,32:32]
        [--prompt-range bench:200:1200] [--trials 1] [--out DIR]

`--quick` (tiny preset, a minute or two) writes to $TMPDIR/lockstep-bench-quick unless
--out says otherwise; it is a smoke, not a result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import RESULTS, write_result
from bench import cpu_breakdown as cb
from bench import servers as sv
from bench.chat_client import CLIENT, Reply, run_concurrent, summarize
from bench.gateway_summary import summarize_rows, targets
from bench.rank_metrics import phase_us_per_token, rank_phases, rank_token_latency
from bench.workload import chat_prompt_tokens, load_tokenizer, log_uniform_lengths, prose

ROOT = Path(__file__).resolve().parents[1]
MODEL_CACHE = Path(os.environ.get("LOCKSTEP_BENCH_MODELS",
                                  Path.home() / ".cache" / "lockstep-bench" / "models"))


@dataclass
class Config:
    presets: tuple[str, ...] = ("bench", "tiny")
    concurrencies: tuple[int, ...] = (1, 8, 32)
    on_concurrencies: tuple[int, ...] | None = None  # the cache-on row's; None: the same
    requests: dict[int, int] = field(default_factory=lambda: {1: 4, 8: 16, 32: 32})
    prompt_tokens: dict[str, tuple[int, int]] = field(
        default_factory=lambda: {"tiny": (300, 3000), "bench": (200, 1200)})
    max_tokens: dict[str, int] = field(default_factory=lambda: {"tiny": 128, "bench": 64})
    tps: tuple[int, ...] = (1, 2)
    caches: tuple[str, ...] = ("off", "on")
    trials: int = 1  # each measurement is already N(C) requests; ratios are in-run
    inproc_presets: tuple[str, ...] = ("tiny",)  # issue 16: tiny end to end vs in-process
    seed: str = "gw-1"


QUICK = Config(presets=("tiny",), concurrencies=(1, 8), requests={1: 2, 8: 8},
               prompt_tokens={"tiny": (200, 800)}, trials=1)


def workload(cfg: Config, tok, preset: str, trial: int, conc: int) -> list[list[dict]]:
    """The same prompts for every system (and both cache rows); distinct per trial."""
    lo, hi = cfg.prompt_tokens[preset]
    key = f"{cfg.seed}/{preset}/t{trial}/c{conc}"
    lengths = log_uniform_lengths(cfg.requests.get(conc, max(4, conc)), lo, hi, key)
    return [[{"role": "user", "content": prose(tok, n, f"{key}/r{i}")}]
            for i, n in enumerate(lengths)]


def warm_workload(tok, preset: str, lo: int) -> list[list[dict]]:
    return [[{"role": "user", "content": prose(tok, lo, f"warm/{preset}/{i}")}] for i in range(4)]


# --- in-process: rank 0's engine ---------------------------------------------------------


def inproc_main(spec_path: str) -> dict:
    """In the child: step an Engine over the spec's prompts, C in flight at a time."""
    import dataclasses

    from mlx_lm import load

    from common.messages import PlanInsert, SeededSampling
    from common.rankspec import RankSettings
    from services.rank.engine import Engine

    spec = json.loads(Path(spec_path).read_text())
    model, tok = load(spec["model"])
    settings = RankSettings()
    if any(f.name == "prompt_cache_entries" for f in dataclasses.fields(settings)):
        settings = dataclasses.replace(settings, prompt_cache_entries=0)  # the cache-off row
    eng = Engine(model, sorted(tok.eos_token_ids), settings)

    def run(prompts: list[list[int]], conc: int, tag: str) -> tuple[list[Reply], float]:
        replies = [Reply(0.0) for _ in prompts]
        todo = list(range(len(prompts)))[::-1]
        by_rid: dict[str, int] = {}
        t0 = time.monotonic()

        def feed(k: int) -> None:
            ins = []
            for _ in range(k):
                if todo:
                    i = todo.pop()
                    by_rid[f"{tag}-{i}"] = i
                    replies[i].sent_at = time.monotonic()
                    ins.append(PlanInsert(f"{tag}-{i}", prompts[i], spec["max_tokens"],
                                          SeededSampling(seed=0)))  # greedy
            if ins:
                eng.apply([], ins)

        feed(conc)
        while eng.has_work():
            emitted, finished = eng.next()
            now = time.monotonic()
            for e in emitted:
                r = replies[by_rid[e.active.request_id]]
                if e.token is not None:
                    r.completion_tokens += 1
                    r.chunk_s.append(now - r.sent_at)
                    if r.ttft_s is None:
                        r.ttft_s = now - r.sent_at
            for f in finished:
                replies[by_rid[f.active.request_id]].done_s = now - replies[by_rid[f.active.request_id]].sent_at
            feed(len(finished))
        for i, p in enumerate(prompts):
            replies[i].prompt_tokens = len(p)
        return replies, time.monotonic() - t0

    run(spec["warm"], 2, "warm")
    out = {}
    me = os.getpid()
    for key, prompts in spec["measure"].items():
        cpu0 = cb.snapshot(lambda: {"inproc": me})
        replies, secs = run(prompts, int(key.split("/c")[1]), key.replace("/", "-"))
        cpu1 = cb.snapshot(lambda: {"inproc": me})
        out[key] = with_cpu(summarize(replies, secs), cpu0, cpu1)
    out["env"] = {k: os.environ.get(k) for k in sv.ENV_KEYS}
    return out


def inproc(model: Path, work: Path, spec: dict) -> dict:
    path = work / "inproc-spec.json"
    path.write_text(json.dumps({"model": str(model), **spec}))
    proc = subprocess.run([sys.executable, "-m", "bench.gateway", "--inproc", str(path)],
                          cwd=ROOT, env=sv.rank_env(), capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"in-process baseline failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- HTTP systems ------------------------------------------------------------------------


def with_cpu(row: dict, before: cb.Snapshot, after: cb.Snapshot) -> dict:
    """`row` (a summarize() result) with its CPU and wall time per completion token."""
    toks = row["completion_tokens"]
    row["cpu_us_per_token"] = cb.breakdown(before, after, toks)
    row["wall_ms_per_token"] = round(row["seconds"] / toks * 1000, 3) if toks else None
    row["cpus"] = cb.cpus()
    return row


def measure(srv: sv.Server, convs: list[list[dict]], max_tokens: int, conc: int) -> dict:
    """One measurement; the CPU snapshots sit inside the /metrics reads so that those
    reads (and the waits for fresh rank telemetry) are not charged to the tokens."""
    lock = srv.name.startswith("lockstep")
    me = os.getpid()

    def find() -> dict[str, int]:
        return {**srv.processes(), "bench_client": me}

    phases0 = rank_phases(srv) if lock else None
    before = rank_token_latency(srv) if lock else None
    cpu0 = cb.snapshot(find)
    replies, secs = asyncio.run(run_concurrent(srv.url, srv.model, convs, max_tokens, conc))
    cpu1 = cb.snapshot(find)
    out = with_cpu(summarize(replies, secs), cpu0, cpu1)
    if lock:
        s1, c1 = rank_token_latency(srv)
        s0, c0 = before
        if c1 > c0:
            out["rank_token_interval_ms"] = round((s1 - s0) / (c1 - c0) * 1000, 3)
        gw = out["cpu_us_per_token"]["processes"].get("gateway")
        if gw is not None:
            out["gateway_cpu_us_per_token"] = gw["total"]
        out["rank_phase_us_per_token"] = phase_us_per_token(
            phases0, rank_phases(srv), out["completion_tokens"])
    return out


def bench_preset(cfg: Config, preset: str, work: Path, checkpoint) -> dict:
    from models.tinymodel import build_model

    model = build_model(MODEL_CACHE / preset, preset=preset)
    tok = load_tokenizer(model)
    lo, _ = cfg.prompt_tokens[preset]
    max_tokens = cfg.max_tokens[preset]
    loads = {(t, c): workload(cfg, tok, preset, t, c)
             for t in range(cfg.trials) for c in cfg.concurrencies}
    ptoks = [len(chat_prompt_tokens(tok, m)) for w in loads.values() for m in w]
    out: dict = {"model": str(model), "max_tokens": max_tokens, "complete": False,
                 "prompt_tokens": {"range": cfg.prompt_tokens[preset], "min": min(ptoks),
                                   "median": statistics.median(ptoks), "max": max(ptoks),
                                   "total_per_trial": sum(ptoks) // cfg.trials},
                 "servers": [], "trials": {}, "summary": {}}
    warm = warm_workload(tok, preset, lo)
    for cache in cfg.caches:
        concs = cfg.concurrencies if cache == "off" else (cfg.on_concurrencies or cfg.concurrencies)
        rows: dict[str, dict[int, list[dict]]] = {}
        systems: list[tuple[str, object]] = [(f"lockstep_tp{tp}", tp) for tp in cfg.tps]
        systems.append(("mlx_lm", None))
        for name, tp in systems:
            srv = (sv.lockstep(model, work, tp, cache == "on") if tp is not None
                   else sv.mlx_lm(model, work, cache == "on"))
            try:
                asyncio.run(run_concurrent(srv.url, srv.model, warm, 8, 2))  # unmeasured
                for (t, c), convs in loads.items():
                    if c not in concs:
                        continue
                    r = measure(srv, convs, max_tokens, c)
                    r["loadavg"] = os.getloadavg()[0]
                    rows.setdefault(name, {}).setdefault(c, []).append(r)
                    print(f"  {preset} cache {cache} {name:13s} trial {t} conc {c:2d}: "
                          f"{r['tok_s']:8.1f} tok/s ttft p50 {r['ttft_p50_ms']} ms "
                          f"itl p50 {r['itl_p50_ms']} ms", flush=True)
            finally:
                sv.stop(srv)
                out["servers"].append(srv.record())
            out["trials"][f"cache_{cache}"] = rows
            out["summary"][f"cache_{cache}"] = summarize_rows(rows, concs)
            checkpoint(out)
        if cache == "off" and preset in cfg.inproc_presets:
            spec = {"max_tokens": max_tokens,
                    "warm": [chat_prompt_tokens(tok, m) for m in warm[:2]],
                    "measure": {f"t{t}/c{c}": [chat_prompt_tokens(tok, m) for m in convs]
                                for (t, c), convs in loads.items()}}
            res = inproc(model, work, spec)
            out["inproc_env"] = res.pop("env")
            for key, r in res.items():
                r["loadavg"] = os.getloadavg()[0]
                rows.setdefault("inproc", {}).setdefault(int(key.split("/c")[1]), []).append(r)
        out["trials"][f"cache_{cache}"] = rows
        out["summary"][f"cache_{cache}"] = summarize_rows(rows, concs)
        # What the servers said they reused: 0 everywhere proves the cache-off row is off.
        out["summary"][f"cache_{cache}"]["cached_tokens_reported"] = {
            name: sum(r.get("cached_tokens_total") or 0 for rs in by_c.values() for r in rs)
            for name, by_c in rows.items() if name != "inproc"}
        checkpoint(out)
    out["complete"] = True
    checkpoint(out)
    return out


def run(out_dir: Path | str | None = None, cfg: Config | None = None) -> dict:
    cfg = cfg or Config()
    result = {"benchmark": "gateway", "host": platform.node(), "python": platform.python_version(),
              "started": time.time(), "config": asdict(cfg), "client": CLIENT,
              "environment": sv.environment_record(), "presets": {}}
    out = out_dir if out_dir is not None else RESULTS

    def save(preset: str, preset_result: dict) -> None:
        # Written after every server: a run cut short still leaves what it measured.
        result["presets"][preset] = preset_result
        write_result(out, "gateway", {**result, "complete": False,
                                      "targets": targets(result["presets"])})

    with tempfile.TemporaryDirectory(prefix="lockstep-bench-gw-") as tmp:
        for preset in cfg.presets:
            bench_preset(cfg, preset, Path(tmp), lambda r, p=preset: save(p, r))
    result["complete"] = True
    result["targets"] = targets(result["presets"])
    result["seconds"] = round(time.time() - result["started"], 1)
    # Other work on the machine moves these numbers a lot on 2 cores: recorded with them.
    result["loadavg_end"] = os.getloadavg()
    write_result(out, "gateway", result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke on the tiny preset")
    ap.add_argument("--presets", help="comma-separated (default: tiny,bench)")
    ap.add_argument("--concurrency", help="comma-separated (default: 1,8,32)")
    ap.add_argument("--tp", help="comma-separated Lockstep TP sizes (default: 1,2)")
    ap.add_argument("--caches", help="off,on (default: both rows)")
    ap.add_argument("--on-concurrency", help="the cache-on row's concurrencies (default: same)")
    ap.add_argument("--requests", help="requests per concurrency, e.g. 1:4,8:16,32:32")
    ap.add_argument("--prompt-range", action="append", default=[],
                    help="PRESET:LO:HI prompt tokens (repeatable), e.g. bench:200:2000")
    ap.add_argument("--trials", type=int)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--inproc", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.inproc:
        print(json.dumps(inproc_main(a.inproc)))
        return 0
    cfg = QUICK if a.quick else Config()
    if a.presets:
        cfg.presets = tuple(p for p in a.presets.split(",") if p)
    if a.concurrency:
        cfg.concurrencies = tuple(int(c) for c in a.concurrency.split(","))
    if a.tp:
        cfg.tps = tuple(int(t) for t in a.tp.split(","))
    if a.caches:
        cfg.caches = tuple(a.caches.split(","))
    if a.trials:
        cfg.trials = a.trials
    if a.on_concurrency:
        cfg.on_concurrencies = tuple(int(c) for c in a.on_concurrency.split(","))
    if a.requests:
        cfg.requests = {int(c): int(n) for c, n in (x.split(":") for x in a.requests.split(","))}
    for spec in a.prompt_range:
        preset, lo, hi = spec.split(":")
        cfg.prompt_tokens[preset] = (int(lo), int(hi))
    out = a.out
    if a.quick and out is None:  # a smoke never overwrites the committed result
        out = Path(tempfile.gettempdir()) / "lockstep-bench-quick"
    # Killed (SIGTERM, a closed terminal): leave through the finally blocks, which stop
    # the servers it started in their own sessions.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    res = run(out, cfg)
    print(f"wrote {out or RESULTS}/gateway.json")
    print(json.dumps({p: r["summary"] for p, r in res["presets"].items()}, indent=1))
    print(json.dumps(res["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
