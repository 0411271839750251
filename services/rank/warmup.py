"""The warm-up: one throwaway generation every rank runs after the load, before it
reports ready, so that the first real request pays nothing the canary did not.

What a first request paid (SmolLM2-135M, PP=2, 2-core CPU; bench/first_request.py):
MLX's CPU backend has no per-shape JIT (a prefill of a new length or a new decode batch
size costs no more the first time), but every `mx.compile`d function builds its fused
kernels with the system C++ compiler on first use, 0.5-3 s each on a loaded 2-core host,
kept in $TMPDIR/mlx/<version>/cpu for later processes. Without a warm-up, the canary
(8-token greedy prompt) built the model's own (SwiGLU) and the first request sampling
with top_p < 1 built mlx-lm's compiled `apply_top_p` (two kernels: 1.4 s of its model
TTFT on a quiet host with an empty $TMPDIR, 4.6 s on a loaded one) -- every request of
a deployment whose defaults come from a generation_config.json with top_p does so.

So the warm-up runs the request paths the canary skips, through the real sampler and
logits-processor builders (services/rank/sampling.py) and its own `BatchGenerator` with
the engine's arguments (the engine's uids and batch are untouched): a prefill of two rows
of different lengths (left padding), one greedy and one sampling with temperature,
top_p, top_k, min_p and every penalty and a logit bias, then one decode step at
batch 2 (each sampler runs for the prefill's token and the step's). Every
rank runs the same one (a collective under TP/PP pairs with its peers'). Grammars
(llguidance) are not warmed: they are built per request anyway.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from common.messages import PlanInsert, SeededSampling, TokenBias
from services.rank.engine import Engine, generator_kwargs
from services.rank.kv_budget import KvLayoutError, slot_bytes
from services.rank.sampling import logits_processors_for, sampler_for

# Rows: a chat prompt's length (SmolLM2's template around one short question is 37
# tokens) and the canary's; decode steps past the prefill's first token.
ROWS = (40, 8)
DECODE_STEPS = 1


@dataclass(frozen=True)
class WarmReport:
    prefill: tuple[int, ...]  # prompt tokens per row, one prefill batch
    decode_batch: int
    decode_steps: int
    samplers: tuple[str, ...]
    kernels_built: int  # fused CPU kernels that appeared in MLX's cache meanwhile
    seconds: float
    kv_slot_bytes: int = 0  # KV bytes per token slot on this rank, off its decode batch
    kv_layout: str = ""  # why kv_slot_bytes is 0 (a cache kv_budget.py does not describe)

    def line(self) -> str:
        """The rank log's line (tests and the bench look for "warmed: ")."""
        rows = ", ".join(f"1x{n}" for n in self.prefill)
        built = f"; {self.kernels_built} MLX CPU kernels built" if self.kernels_built else ""
        steps = f"{self.decode_steps} step" + ("s" if self.decode_steps != 1 else "")
        return (f"warmed: prefill {len(self.prefill)} rows ({rows}); decode batch "
                f"{self.decode_batch} x {steps}; samplers "
                f"{', '.join(self.samplers)}{built}; in {self.seconds:.2f}s")


def _inserts(vocab: int) -> list[PlanInsert]:
    """The rows: ids below any vocabulary (as the canary's), avoiding 0."""
    def ids(n: int, start: int) -> list[int]:
        return [1 + (start + i) % max(1, min(vocab, 1000) - 1) for i in range(n)]

    sampled = PlanInsert(
        request_id="warm-sampled", prompt=ids(ROWS[0], 10), max_tokens=1 + DECODE_STEPS,
        sampling=SeededSampling(temperature=0.7, top_p=0.9, seed=1, top_k=40, min_p=0.05,
                                presence_penalty=0.1, frequency_penalty=0.1,
                                repetition_penalty=1.1, logit_bias=[TokenBias(5, 1.0)]))
    greedy = PlanInsert(request_id="warm-greedy", prompt=ids(ROWS[1], 1),
                        max_tokens=1 + DECODE_STEPS, sampling=SeededSampling(seed=0))
    return [sampled, greedy]


def _kernel_count() -> int:
    """Compiled CPU kernel libraries in MLX's cache directory (the same for every rank
    of a host: a peer's builds are counted too; a diagnostic, not a guarantee)."""
    root = os.environ.get("TMPDIR") or "/tmp"
    return len(glob.glob(os.path.join(root, "mlx", "*", "cpu", "*.so")))


def warm_up(model, engine: Engine, settings, vocab: int) -> WarmReport:
    """Run the warm-up generation to its end on this rank; raise whatever MLX raises."""
    t0 = time.monotonic()
    before = _kernel_count()
    inserts = _inserts(vocab)
    # No stop tokens: every row runs its max_tokens, so the decode batch stays 2.
    gen = BatchGenerator(model, stop_tokens=[], **generator_kwargs(settings))
    try:
        gen.insert([list(i.prompt) for i in inserts], max_tokens=[i.max_tokens for i in inserts],
                   samplers=[sampler_for(i) for i in inserts],
                   logits_processors=[logits_processors_for(i, engine) for i in inserts])
        left = len(inserts)
        slot, layout = 0, ""
        while left:
            _, responses = gen.next()
            if not slot and not layout and len(gen._generation_batch):  # mlx-lm 0.32's
                try:
                    slot = slot_bytes(gen._generation_batch.prompt_cache)
                except KvLayoutError as exc:
                    layout = str(exc)
            left -= sum(1 for r in responses if r.finish_reason is not None)
        mx.synchronize(gen.stream)
    finally:
        gen.close()
        del gen
        mx.clear_cache()
    after = _kernel_count()
    return WarmReport(
        prefill=tuple(len(i.prompt) for i in inserts), decode_batch=len(inserts),
        decode_steps=DECODE_STEPS,
        samplers=("greedy", "temperature+top_p+top_k+min_p, penalties, logit_bias"),
        kernels_built=max(0, after - before),
        seconds=time.monotonic() - t0, kv_slot_bytes=slot,
        kv_layout=layout or ("" if slot else "the warm-up's decode batch held no KV"))
