"""Rank benchmark: what the rank service costs, and what sharding and OpenBLAS buy.

- loop overhead (tiny and bench presets): tokens/s of a served single rank (rank 0's
  loop: plans, signed TOKENS to a DEALER client) vs a bare mlx-lm BatchGenerator loop on the
  same model, same BatchGenerator arguments, same prompts and batch, same environment
  (OpenBLAS preload included), in the same run; trials alternate (ABBA), best of each.
  Target: ratio >= 0.95 at batch 1 and 8. Also CPU seconds per token (all threads of
  the process), which other load on the machine does not distort.
- sharding (bench preset): TP=2 and PP=2 vs one rank, batch 1 and 8; the ratio.
- idle CPU: each rank of an idle TP=2 deployment over 10 s (target < 2% of a core).
- OpenBLAS (bench preset): one rank with and without the preload, batch 1 and 8, the
  greedy tokens of both compared; and fp32 matmul GFLOP/s with and without.

`python -m bench.rank [--quick]` writes bench/results/rank.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import RESULTS, write_result
from common.rank_env import find_openblas, rank_environment
from common.rankspec import RankSettings
from tests.e2e.rank_harness import REPO, Deployment, model_dir

NAME = "rank"
TARGET_RATIO = 0.95
TARGET_IDLE_PCT = 2.0


def prompts(batch: int) -> list[list[int]]:
    return [[5 + i, 6, 7, 8, 9 + i, 10, 11, 12, 13, 14, 15, 16, 17 + i, 18, 19, 20]
            for i in range(batch)]


# -- the bare loop (child process) -------------------------------------------------------


def bare_child(model: str, batch: int, tokens: int) -> dict[str, Any]:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from services.rank.engine import generator_kwargs

    m, tok = load(model)
    gen = BatchGenerator(m, stop_tokens=[[t] for t in sorted(tok.eos_token_ids)],
                         **generator_kwargs(RankSettings()))

    def once(ps: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        nonlocal cpu
        t0, c0 = time.perf_counter(), time.process_time()
        uids = gen.insert(ps, max_tokens=[n] * len(ps))
        out: dict[int, list[int]] = {u: [] for u in uids}
        left = set(uids)
        while left:
            for r in gen.next()[1]:
                out[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    left.discard(r.uid)
        cpu = time.process_time() - c0
        return time.perf_counter() - t0, [out[u] for u in uids]

    cpu = 0.0
    once([[5, 6, 7, 8]], 4)  # warm-up, as the served path gets
    dt, toks = once(prompts(batch), tokens)
    return {"seconds": dt, "cpu_s": cpu, "tokens": sum(len(t) for t in toks), "outputs": toks}


def bare(model: Path, batch: int, tokens: int, settings: RankSettings) -> dict[str, Any]:
    env = rank_environment(settings, os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "bench.rank", "--bare", str(model), str(batch),
                          str(tokens)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["tps"] = r["tokens"] / r["seconds"]
    return r


def served(d: Deployment, batch: int, tokens: int) -> dict[str, Any]:
    d.generate([5, 6, 7, 8], 4, timeout=300)  # warm-up
    rank0 = psutil.Process(d.procs[0].pid)
    c0 = rank0.cpu_times()
    t0 = time.perf_counter()
    rids = [d.submit(p, tokens) for p in prompts(batch)]
    res = [d.result(r, timeout=900) for r in rids]
    dt = time.perf_counter() - t0
    c1 = rank0.cpu_times()
    n = sum(len(r.tokens) for r in res)
    return {"seconds": dt, "cpu_s": (c1.user + c1.system) - (c0.user + c0.system), "tokens": n,
            "tps": n / dt, "outputs": [r.tokens for r in res]}


# -- sections ------------------------------------------------------------------------------


def loop_overhead(root: Path, trials: int, tokens: int, preset: str = "tiny") -> dict[str, Any]:
    model = model_dir(preset)
    out: dict[str, Any] = {"preset": preset, "tokens_per_request": tokens, "trials": trials}
    with Deployment(root / f"overhead-{preset}", mode="single", preset=preset) as d:
        for batch in (1, 8):
            b_tps, s_tps, b_cpu, s_cpu = [], [], [], []
            same = True
            for t in range(trials):
                order = ("bare", "served") if t % 2 == 0 else ("served", "bare")
                for which in order:
                    r = bare(model, batch, tokens, d.settings) if which == "bare" \
                        else served(d, batch, tokens)
                    (b_tps if which == "bare" else s_tps).append(r["tps"])
                    (b_cpu if which == "bare" else s_cpu).append(r["cpu_s"] / r["tokens"])
                    if which == "bare":
                        ref = r["outputs"]
                    else:
                        got = r["outputs"]
                same = same and got == ref
            ratio = max(s_tps) / max(b_tps)
            pairs = sorted(s / b for s, b in zip(s_tps, b_tps, strict=True))
            out[f"batch{batch}"] = {
                "bare_tps": round(max(b_tps), 1), "served_tps": round(max(s_tps), 1),
                "bare_trials": [round(x, 1) for x in b_tps],
                "served_trials": [round(x, 1) for x in s_tps],
                "ratio": round(ratio, 3), "meets_target": ratio >= TARGET_RATIO,
                "ratio_median_of_pairs": round(pairs[len(pairs) // 2], 3),
                # CPU seconds per token (all threads of the process): insensitive to
                # other load on the machine, unlike wall-clock tokens/s.
                "bare_cpu_ms_per_token": round(1000 * min(b_cpu), 3),
                "served_cpu_ms_per_token": round(1000 * min(s_cpu), 3),
                "cpu_ratio": round(min(b_cpu) / min(s_cpu), 3),
                "same_tokens": same}
    return out


def sharding(root: Path, tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": "bench", "tokens_per_request": tokens}
    for mode in ("single", "tp", "pp"):
        with Deployment(root / f"shard-{mode}", mode=mode, preset="bench") as d:
            out[mode] = {f"batch{b}_tps": round(max(served(d, b, tokens)["tps"]
                                                    for _ in range(2)), 1) for b in (1, 8)}
    for mode in ("tp", "pp"):
        for b in (1, 8):
            out[mode][f"batch{b}_ratio_vs_single"] = round(
                out[mode][f"batch{b}_tps"] / out["single"][f"batch{b}_tps"], 2)
    return out


def idle_cpu(root: Path, seconds: float) -> dict[str, Any]:
    with Deployment(root / "idle", mode="tp") as d:
        d.generate([5, 6, 7, 8], 8)
        time.sleep(1.0)  # let the last step's bookkeeping settle
        procs = {r: psutil.Process(p.pid) for r, p in d.procs.items()}
        before = {r: p.cpu_times() for r, p in procs.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        wall = time.monotonic() - t0
        pct = {}
        for r, p in procs.items():
            a, b = p.cpu_times(), before[r]
            pct[f"rank{r}"] = round(100 * ((a.user + a.system) - (b.user + b.system)) / wall, 2)
    return {"seconds": seconds, "cpu_pct_of_core": pct,
            "meets_target": all(v < TARGET_IDLE_PCT for v in pct.values())}


GEMM = """
import mlx.core as mx, time
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b)
for _ in range(3): mx.eval(a @ b)
t = time.perf_counter(); n = 20
for _ in range(n): mx.eval(a @ b)
print(2 * 1024 ** 3 * n / (time.perf_counter() - t) / 1e9)
"""


def openblas(root: Path, tokens: int) -> dict[str, Any]:
    lib = find_openblas()
    out: dict[str, Any] = {"library": lib, "preset": "bench", "tokens_per_request": tokens}
    if lib is None:
        out["skipped"] = "no OpenBLAS library on this host (apt-get install libopenblas0-pthread)"
        return out
    for on in (False, True):
        env = rank_environment(RankSettings(openblas=on), os.environ)
        gflops = subprocess.run([sys.executable, "-c", GEMM], env=env, capture_output=True,
                                text=True, timeout=300, check=True).stdout.strip()
        key = "on" if on else "off"
        out[key] = {"gemm_fp32_gflops": round(float(gflops), 1)}
        with Deployment(root / f"blas-{key}", mode="single", preset="bench",
                        settings={"openblas": on}) as d:
            for b in (1, 8):
                r = served(d, b, tokens)
                out[key][f"batch{b}_tps"] = round(r["tps"], 1)
                out[key][f"batch{b}_outputs"] = r["outputs"]
    for b in (1, 8):
        out[f"batch{b}_speedup"] = round(out["on"][f"batch{b}_tps"] / out["off"][f"batch{b}_tps"], 2)
        out[f"batch{b}_same_greedy_tokens"] = \
            out["on"].pop(f"batch{b}_outputs") == out["off"].pop(f"batch{b}_outputs")
    return out


def run(out_dir: Path | str | None = None, *, quick: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-rank-"))
    model_dir("tiny")
    model_dir("bench")
    result: dict[str, Any] = {"name": NAME, "host": {"cpus": os.cpu_count()}}
    result["loop_overhead"] = loop_overhead(root, trials=2 if quick else 6,
                                            tokens=64 if quick else 128)
    result["loop_overhead_bench_preset"] = loop_overhead(root, trials=2, tokens=16 if quick
                                                         else 48, preset="bench")
    result["idle"] = idle_cpu(root, 3.0 if quick else 10.0)
    result["sharding"] = sharding(root, tokens=16 if quick else 48)
    result["openblas"] = openblas(root, tokens=16 if quick else 48)
    lo, sh, ob = result["loop_overhead"], result["sharding"], result["openblas"]
    lb = result["loop_overhead_bench_preset"]
    result["summary"] = (
        f"loop/bare tiny b1={lo['batch1']['ratio']} b8={lo['batch8']['ratio']} "
        f"(cpu b1={lo['batch1']['cpu_ratio']} b8={lo['batch8']['cpu_ratio']}), "
        f"bench b1={lb['batch1']['ratio']} b8={lb['batch8']['ratio']}; "
        f"TP2 b1={sh['tp']['batch1_ratio_vs_single']}x b8={sh['tp']['batch8_ratio_vs_single']}x; "
        f"PP2 b1={sh['pp']['batch1_ratio_vs_single']}x b8={sh['pp']['batch8_ratio_vs_single']}x; "
        f"idle%={result['idle']['cpu_pct_of_core']}; "
        f"openblas b1={ob.get('batch1_speedup')}x b8={ob.get('batch8_speedup')}x")
    write_result(out_dir, NAME, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rank", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="fewer trials and tokens")
    ap.add_argument("--bare", nargs=3, metavar=("MODEL", "BATCH", "TOKENS"),
                    help=argparse.SUPPRESS)  # internal: the bare loop's child process
    args = ap.parse_args(argv)
    if args.bare:
        print(json.dumps(bare_child(args.bare[0], int(args.bare[1]), int(args.bare[2]))))
        return 0
    print(json.dumps(run(args.out, quick=args.quick)["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
