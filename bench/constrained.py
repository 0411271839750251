"""Constrained decoding's cost: decode tokens/s at batch 8, with a grammar vs without.

Rank 0's `Engine` in-process (a subprocess with the rank environment, as bench.gateway's
inproc row), the embedded tiny model, 8 requests inserted at once, seeded sampling at
temperature 0.8, `max_tokens` 128. Constrained: every request carries the gateway's
grammar for `{"type": "string", "minLength": 2000}` — a long JSON string (a "summary"
field), the state where most tokens are allowed and llguidance's lexer works hardest,
and one that cannot close within 128 tokens, so the batch stays full as it does without
a grammar (a plain `{"type": "string"}` lets the random model close it early and the
batch shrinks: fewer tokens per step, not a slower mask). Unconstrained: the same
requests without it. Only decode steps are timed (from the first emitted token); trials
alternate; medians are reported. On this shared 2-core machine single trials vary ±40%.

Written as key "constrained" of `<out>/sampling.json` (merged: other keys of that file,
e.g. the processors on/off row, are kept), and returned for bench's own record.

    python -m bench.constrained [--trials 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8
MAX_TOKENS = 128
SCHEMA = {"type": "string", "minLength": 2000}


def child(trials: int) -> dict:
    from mlx_lm import load

    from common.messages import PlanInsert, SeededSampling
    from common.rankspec import RankSettings
    from services.gateway.core.detok import load_tokenizer
    from services.gateway.core.structured import json_grammar
    from services.rank.engine import Engine
    from services.rank.grammar import RankGrammars
    from tests.e2e.rank_harness import model_dir

    path = model_dir("tiny")
    model, tok = load(str(path))
    eos = sorted(tok.eos_token_ids)
    vocab = int(model.args.vocab_size)
    grammar = json_grammar(SCHEMA, load_tokenizer(path), "schema", "the bench schema")
    eng = Engine(model, eos, RankSettings(), grammars=RankGrammars(tok, eos, vocab))
    prompts = [tok.encode(f"Request {i}: describe the weather in one sentence.")
               for i in range(BATCH)]

    def one(tag: str, constrained: bool) -> dict:
        eng.apply([], [PlanInsert(f"{tag}-{i}", p, MAX_TOKENS, SeededSampling(
                           temperature=0.8, seed=1000 + i, grammar=grammar if constrained else ""))
                       for i, p in enumerate(prompts)])
        t0, tokens, steps, rows = None, 0, 0, 0
        while eng.has_work():
            emitted, _ = eng.next()
            if t0 is None:
                if emitted:
                    t0 = time.perf_counter()
                continue
            steps += 1
            rows += len(emitted)
            tokens += sum(e.token is not None for e in emitted)
        secs = time.perf_counter() - t0
        return {"tps": tokens / secs, "mean_batch": rows / max(1, steps)}

    one("warm-off", False)
    one("warm-on", True)
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for t in range(trials):
        for mode in (("off", "on") if t % 2 == 0 else ("on", "off")):
            rows[mode].append(one(f"t{t}-{mode}", mode == "on"))
    med = {m: round(statistics.median(r["tps"] for r in rows[m]), 1) for m in rows}
    return {
        "preset": "tiny", "batch": BATCH, "max_tokens": MAX_TOKENS, "temperature": 0.8,
        "schema": SCHEMA, "trials": trials,
        "unconstrained_tps": med["off"], "constrained_tps": med["on"],
        "overhead": round(1 - med["on"] / med["off"], 3),
        "meets_target": med["on"] >= 0.9 * med["off"],  # issue 15: overhead <= 10%
        "mean_batch": {m: round(statistics.median(r["mean_batch"] for r in rows[m]), 2)
                       for m in rows},
        "trials_tps": {m: [round(r["tps"], 1) for r in rows[m]] for m in rows},
    }


def run(out_dir: Path | str | None = None, trials: int = 7) -> dict:
    from bench import servers as sv

    proc = subprocess.run([sys.executable, "-m", "bench.constrained", "--child", str(trials)],
                          cwd=ROOT, env={**sv.rank_env(), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"constrained bench failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = Path(out_dir) if out_dir is not None else RESULTS
    path = out / "sampling.json"
    merged = json.loads(path.read_text()) if path.exists() else {"name": "sampling"}
    merged["constrained"] = result
    write_result(out, "sampling", merged)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", type=int, default=None)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child)))
    else:
        print(json.dumps(run(a.out, a.trials), indent=2))
