"""What determinism costs (issue 41): the batch-invariant forward pass
(services/rank/determinism.py) against mlx-lm's own, on served ranks of the bench preset.

Two deployments of the same model at once (rank harness, OpenBLAS preloaded as the
supervisor would), one with `deterministic` on and one off, same BatchGenerator settings,
prefix cache on for both (every prompt is distinct, so nothing hits). For one rank and for
TP=2, at concurrency 1 and 8: distinct prompts of 300-1500 tokens (log-uniform, prose from
the model's tokenizer), the same prompts to both in a trial, new prompts each trial;
trials alternate which deployment goes first (ABBA). Reported per case: decode tokens/s
(all generated tokens over the wall time from submit to the last token; `decode_tps`: the tokens after each
request's first over the time from the first first token to the last), model TTFT
(rank 0's receipt to first token, median over the requests), and CPU seconds per token
over every rank; median of the trials, their spread, and the on/off ratios.

Targets (the issue's): tokens/s at c=8 >= 0.7x today's, TTFT <= 1.3x.

`python -m bench.determinism [--trials N] [--quick]` writes bench/results/determinism.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import RESULTS, write_result
from bench.workload import load_tokenizer, log_uniform_lengths, prose
from common.rank_env import find_openblas
from tests.e2e.rank_harness import Deployment, model_dir

NAME = "determinism"
PRESET = "bench"
TARGET_TPS_C8 = 0.7
TARGET_TTFT = 1.3


def _prompts(tok, c: int, trial: int, mode: str) -> list[list[int]]:
    lengths = log_uniform_lengths(c, 300, 1500, f"det-{mode}-{c}-{trial}")
    return [tok.encode(prose(tok, n, f"det-{mode}-{c}-{trial}-{i}")) for i, n in
            enumerate(lengths)]


def _cpu(d: Deployment) -> float:
    total = 0.0
    for p in d.procs.values():
        t = psutil.Process(p.pid).cpu_times()
        total += t.user + t.system
    return total


def _once(d: Deployment, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    c0, t0 = _cpu(d), time.perf_counter()
    rids = [d.submit(p, max_tokens) for p in prompts]
    res = [d.result(r, timeout=1800) for r in rids]
    dt, cpu = time.perf_counter() - t0, _cpu(d) - c0
    n = sum(len(r.tokens) for r in res)
    assert all(r.error is None for r in res), [r.error for r in res]
    # decode: the tokens after each request's first, over the time from the first first
    # token to the last token (prefill excluded as far as the batch allows)
    first = min(r.token_times[0] for r in res)
    last = max(r.token_times[-1] for r in res)
    return {"tps": n / dt, "decode_tps": (n - len(res)) / (last - first),
            "ttft_ms": statistics.median(r.model_ttft_ms for r in res),
            "cpu_ms_per_token": 1000 * cpu / n, "tokens": n,
            "prompt_tokens": sum(len(p) for p in prompts)}


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2),
            "max": round(max(xs), 2)}


def compare(root: Path, mode: str, trials: int, tok) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs: dict[tuple[str, int], list[dict]] = {}
    with Deployment(root / f"{mode}-on", mode=mode, preset=PRESET,
                    settings={"deterministic": True}) as on, \
            Deployment(root / f"{mode}-off", mode=mode, preset=PRESET,
                       settings={"deterministic": False}) as off:
        for d in (on, off):
            d.generate([5, 6, 7, 8], 4, timeout=600)  # warm: kernels, first shapes
        for trial in range(trials):
            order = (("on", on), ("off", off)) if trial % 2 == 0 else \
                (("off", off), ("on", on))
            for c, max_tokens in ((1, 128), (8, 64)):
                prompts = _prompts(tok, c, trial, mode)
                for label, d in order:
                    runs.setdefault((label, c), []).append(_once(d, prompts, max_tokens))
    for c in (1, 8):
        case: dict[str, Any] = {}
        for label in ("on", "off"):
            rs = runs[(label, c)]
            case[label] = {k: _summary([r[k] for r in rs])
                           for k in ("tps", "decode_tps", "ttft_ms", "cpu_ms_per_token")}
            case[label]["trials_tps"] = [round(r["tps"], 2) for r in rs]
        pairs = list(zip(runs[("on", c)], runs[("off", c)], strict=True))
        case["tps_ratio"] = _summary([a["tps"] / b["tps"] for a, b in pairs])
        case["decode_tps_ratio"] = _summary([a["decode_tps"] / b["decode_tps"]
                                             for a, b in pairs])
        case["ttft_ratio"] = _summary([a["ttft_ms"] / b["ttft_ms"] for a, b in pairs])
        case["cpu_per_token_ratio"] = _summary(
            [a["cpu_ms_per_token"] / b["cpu_ms_per_token"] for a, b in pairs])
        out[f"c{c}"] = case
    out["meets_targets"] = (out["c8"]["tps_ratio"]["median"] >= TARGET_TPS_C8
                            and out["c1"]["ttft_ratio"]["median"] <= TARGET_TTFT
                            and out["c8"]["ttft_ratio"]["median"] <= TARGET_TTFT)
    return out


def run(out_dir: Path | str | None = None, *, trials: int = 5,
        quick: bool = False) -> dict[str, Any]:
    tok = load_tokenizer(model_dir(PRESET))
    result: dict[str, Any] = {
        "preset": PRESET, "trials": trials, "order": "ABBA (alternating first)",
        "openblas": find_openblas(), "prompt_tokens": "300-1500, log-uniform, distinct",
        "max_tokens": {"c1": 128, "c8": 64}, "prefix_cache": "on for both (no hits)",
        "targets": {"c8_tps_ratio_min": TARGET_TPS_C8, "ttft_ratio_max": TARGET_TTFT}}
    with tempfile.TemporaryDirectory(prefix="bench-det-") as tmp:
        for mode in (("single",) if quick else ("single", "tp")):
            result["tp1" if mode == "single" else "tp2"] = compare(Path(tmp), mode, trials, tok)
    write_result(Path(out_dir) if out_dir else RESULTS, NAME, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.determinism")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one rank only")
    args = ap.parse_args(argv)
    import json

    print(json.dumps(run(trials=args.trials, quick=args.quick), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
