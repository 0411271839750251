"""Cancel latency (DESIGN.md §11): abort → removed on every rank, in ms and decode steps.

A real TP=2 deployment of the embedded model (ranks driven by tests/e2e/rank_harness.py,
which plays supervisor and gateway over the real sockets) decodes a batch of long
requests; one of them is aborted mid-decode. Evidence comes from each rank's own removal
record (`rank-<r>.removals.jsonl`): the wall time it wrote the removal and the step it
applied it at, against the abort's send time and the last step rank 0 had streamed.

    python -m bench.cancel [--runs N] [--batch B]   → bench/results/cancel.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import write_result

PROMPT = [11, 42, 7, 99, 23, 5, 61, 18]


def _one(dep, batch: int) -> dict[str, Any]:
    rids = [dep.submit(PROMPT[: 3 + i % 5], max_tokens=2000) for i in range(batch)]
    victim = rids[0]
    dep.wait_tokens(victim, 24)
    last_step = max(c.step for c in dep.chunks(victim))
    sent = time.time()
    dep.abort(victim, "bench")
    recs = {}
    for rank in (0, 1):
        recs[rank] = dep.wait(
            lambda r=rank: next((x for x in dep.removals(r) if x["request_id"] == victim), None),
            30.0, f"rank {rank}'s removal of {victim}")
    for rid in rids[1:]:
        dep.abort(rid, "bench-cleanup")
    for rid in rids:
        dep.result(rid, 60.0)
    return {
        "ms": {r: round((x["at"] - sent) * 1000, 2) for r, x in recs.items()},
        "steps_after_abort": {r: x["step"] - last_step for r, x in recs.items()},
        "same_step_on_every_rank": len({x["step"] for x in recs.values()}) == 1,
    }


def run(out_dir: Path | str | None = None, runs: int = 10, batch: int = 4) -> dict[str, Any]:
    from tests.e2e.rank_harness import Deployment

    samples = []
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-cancel-") as tmp:
        with Deployment(Path(tmp), mode="tp") as dep:
            for _ in range(runs):
                samples.append(_one(dep, batch))
    worst_ms = [max(s["ms"].values()) for s in samples]
    steps = [max(s["steps_after_abort"].values()) for s in samples]
    result = {
        "benchmark": "cancel",
        "what": "abort sent → removal recorded on every rank of a TP=2 deployment",
        "runs": runs,
        "batch": batch,
        "latency_ms": {"median": round(statistics.median(worst_ms), 2),
                       "max": round(max(worst_ms), 2)},
        "decode_steps_after_abort": {"median": statistics.median(steps), "max": max(steps)},
        "same_step_on_every_rank": all(s["same_step_on_every_rank"] for s in samples),
        "samples": samples,
    }
    write_result(out_dir, "cancel", result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    r = run(None, a.runs, a.batch)
    print({k: r[k] for k in ("latency_ms", "decode_steps_after_abort", "same_step_on_every_rank")})


if __name__ == "__main__":
    main()
