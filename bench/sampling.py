"""Sampling benchmark: what the per-request logits processors and logprobs cost.

Decode tokens/s at batch 8 of an mlx-lm `BatchGenerator` driven as a rank drives it
(services/rank/sampling.py samplers, seeded, temperature 0.8), with every processor off
vs all on: logit_bias (16 tokens), repetition_penalty 1.1 over 64 tokens, presence and
frequency penalties, top_k 40 and min_p 0.05 in the sampler, and rank 0's top-5
logprobs extraction each step (services/rank/logprobs.py). Same model, prompts and
generator arguments; trials alternate (ABAB), best of each. Target: overhead <= 10%
(of wall-clock tokens/s, or of CPU time per token when the machine is shared).
In one process, no network: the processors' own cost, not the service's.

`python -m bench.sampling [--quick]` writes bench/results/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench import write_result
from common.messages import PlanInsert, SeededSampling, TokenBias
from common.rank_env import rank_environment
from common.rankspec import RankSettings
from tests.e2e.rank_harness import REPO, model_dir

NAME = "sampling"
TARGET_OVERHEAD = 0.10
BATCH = 8


def inserts(on: bool, tokens: int) -> list[PlanInsert]:
    extra: dict[str, Any] = {}
    if on:
        extra = {"top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                 "repetition_penalty": 1.1, "repetition_context_size": 64,
                 "logit_bias": [TokenBias(t, 1.5) for t in range(100, 116)]}
    return [PlanInsert(request_id=f"r{i}", prompt=[5 + i, 6, 7, 8, 9 + i, 10, 11, 12, 13, 14],
                       max_tokens=tokens, top_logprobs=5 if on else -1,
                       sampling=SeededSampling(temperature=0.8, top_p=1.0, seed=1000 + i, **extra))
            for i in range(BATCH)]


def decode_tps(model, eos: list[int], on: bool, tokens: int) -> tuple[float, float]:
    """Decode (tokens/s, CPU seconds per token) once every request is past its prompt
    (prefill excluded). CPU time counts every thread of this process: other load on the
    machine does not distort it, unlike wall-clock tokens/s."""
    from mlx_lm.generate import BatchGenerator

    from services.rank.engine import generator_kwargs
    from services.rank.logprobs import extract
    from services.rank.sampling import logits_processors_for, sampler_for

    class Ctx:
        eos_ids = eos

    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos],
                         **generator_kwargs(RankSettings()))
    ins = inserts(on, tokens)
    gen.insert([i.prompt for i in ins], max_tokens=[i.max_tokens for i in ins],
               samplers=[sampler_for(i) for i in ins],
               logits_processors=[logits_processors_for(i, Ctx) for i in ins])
    k = {u: i.top_logprobs for u, i in enumerate(ins)}
    n = 0
    t0 = c0 = None
    left = BATCH
    while left:
        _, responses = gen.next()
        if t0 is None and responses:  # the first decode step: every prompt is in
            t0, c0 = time.perf_counter(), time.process_time()
            continue
        asked = [r for r in responses if k[r.uid] >= 0]
        if asked:
            extract([r.logprobs for r in asked], [int(r.token) for r in asked],
                    [k[r.uid] for r in asked])
        n += len(responses)
        left -= sum(r.finish_reason is not None for r in responses)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    gen.close()
    return n / dt, cpu / n


def section(preset: str, trials: int, tokens: int) -> dict[str, Any]:
    from mlx_lm import load

    model, tok = load(str(model_dir(preset)))
    eos = sorted(tok.eos_token_ids)
    decode_tps(model, eos, True, 8)  # warm-up (graph shapes, allocator)
    off, on, off_cpu, on_cpu = [], [], [], []
    for t in range(trials):
        for which in ((False, True) if t % 2 == 0 else (True, False)):
            tps, cpu = decode_tps(model, eos, which, tokens)
            (on if which else off).append(tps)
            (on_cpu if which else off_cpu).append(cpu)
    overhead = 1 - max(on) / max(off)
    cpu_overhead = min(on_cpu) / min(off_cpu) - 1
    return {"preset": preset, "batch": BATCH, "tokens_per_request": tokens, "trials": trials,
            "off_tps": round(max(off), 1), "on_tps": round(max(on), 1),
            "off_trials": [round(x, 1) for x in off], "on_trials": [round(x, 1) for x in on],
            "overhead": round(overhead, 3),
            "off_cpu_ms_per_token": round(1000 * min(off_cpu), 3),
            "on_cpu_ms_per_token": round(1000 * min(on_cpu), 3),
            "cpu_overhead": round(cpu_overhead, 3),
            "meets_target": min(overhead, cpu_overhead) <= TARGET_OVERHEAD}


def child(preset: str, trials: int, tokens: int) -> dict[str, Any]:
    """One section in a child with a rank's environment (the OpenBLAS preload included),
    as a rank runs."""
    model_dir(preset)  # built here, not timed there
    env = rank_environment(RankSettings(), os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "bench.sampling", "--child", preset,
                          str(trials), str(tokens)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(out_dir=None, *, quick: bool = False) -> dict[str, Any]:
    trials, tokens = (2, 32) if quick else (4, 64)
    result = {"target_overhead": TARGET_OVERHEAD,
              "tiny": child("tiny", trials, tokens),
              "bench": child("bench", trials, tokens)}
    write_result(out_dir, NAME, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampling",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer trials and tokens")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # internal: one section
    args = ap.parse_args(argv)
    if args.child:
        preset, trials, tokens = args.child
        print(json.dumps(section(preset, int(trials), int(tokens))))
        return 0
    r = run(args.out, quick=args.quick)
    for p in ("tiny", "bench"):
        s = r[p]
        print(f"{p}: off {s['off_tps']} tok/s, on {s['on_tps']} tok/s, overhead "
              f"{100 * s['overhead']:.1f}% (CPU per token {100 * s['cpu_overhead']:.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
