"""The determinism harness, run in a process with a rank's environment (its BLAS):

    python -m tests.support.invariance_harness MODEL_DIR --mode on|off [--tokens N]
                                               [--greedy-only] [--chunks 7,64]
                                               [--prompt-tokens 160]

prints one JSON object: `ops` (each operation of the forward pass, checked on its own:
does a row get the same bits alone and in company, in a prefill and in a decode step)
and `runs` (one request through mlx-lm's BatchGenerator, as the engine drives it, in
each situation the contract names, against the request alone: null if identical, else
where it first differs). `--mode off` is today's path (mlx-lm's own ops), `on` the
rank's deterministic mode (services/rank/determinism.py).
"""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import llguidance as llg
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask

from common.messages import SeededSampling
from services.rank import determinism
from services.rank.grammar import RankGrammars
from services.rank.invariant_attention import invariant_sdpa
from tests.support.invariance import Companion, Run, first_difference, generate, prefix_cache
from tests.support.speculation import Row, drafts_for, prefills, verified_runs

SEED = 20261206


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b))


def _weight(m) -> mx.array:
    return m.inner.weight if isinstance(m, determinism.RowFloor) else m.weight


def check_ops(model, mode: str) -> dict[str, bool]:
    """Each operation on random data shaped like the model's: True if invariant."""
    mx.random.seed(SEED)
    layer = model.layers[0]
    attn = layer.self_attn
    Hq, Hkv = attn.n_heads, attn.n_kv_heads
    D = _weight(attn.q_proj).shape[0] // Hq
    S, pad = 300, 13

    def sdpa(q, k, v, mask):
        if mode == "on":
            return invariant_sdpa(q, k, v, 0.125, mask)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    q = mx.random.normal((1, Hq, S, D))
    k = mx.random.normal((1, Hkv, S, D))
    v = mx.random.normal((1, Hkv, S, D))
    full = sdpa(q, k, v, "causal")
    out: dict[str, bool] = {}
    # a decode step over exactly its keys equals the prefill's row
    out["attention: a prefill row vs a decode step"] = all(
        _same(sdpa(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], None)[:, :, 0],
              full[:, :, i]) for i in (0, 1, 63, 64, 130, 257, S - 1))
    # a prompt prefilled in chunks equals one prefill
    parts = [sdpa(q[:, :, a:a + 37], k[:, :, :a + 37], v[:, :, :a + 37], "causal")
             for a in range(0, S, 37)]
    out["attention: prefill in chunks vs one"] = _same(mx.concatenate(parts, axis=2), full)
    # the row left-padded in a batch with another row equals the row alone
    z = mx.zeros((1, Hkv, pad, D))
    K = mx.concatenate([mx.concatenate([z, k], axis=2), mx.random.normal((1, Hkv, S + pad, D))])
    V = mx.concatenate([mx.concatenate([z, v], axis=2), mx.random.normal((1, Hkv, S + pad, D))])
    Q = mx.concatenate([q[:, :, -1:], mx.random.normal((1, Hq, 1, D))])
    mask = create_causal_mask(1, offset=S + pad - 1, left_padding=mx.array([pad, 0]))
    out["attention: left-padded in a batch vs alone"] = _same(sdpa(Q, K, V, mask)[0, :, 0],
                                                              full[0, :, -1])
    # every Linear's rows (as the model calls it: row-floored or not): one row alone vs
    # among 64, one per weight shape
    modules = [m for _, m in model.named_modules()]
    linears = {tuple(_weight(m).shape): m for m in modules if isinstance(m, determinism.RowFloor)}
    for m in modules:
        if isinstance(m, nn.Linear):
            linears.setdefault(tuple(m.weight.shape), m)
    rows_ok = True
    for (_, n_in), m in linears.items():
        x = mx.random.normal((64, n_in))
        rows_ok &= all(_same(m(x[i:i + n]), m(x)[i:i + n]) for n in (1, 2, 4) for i in (0, 9))
    out["linear: a row alone vs among 64 (every weight shape)"] = rows_ok
    x = mx.random.normal((64, model.layers[0].input_layernorm.weight.shape[0]))
    norm = layer.input_layernorm
    out["rms_norm: a row alone vs among 64"] = _same(norm(x[5:6]), norm(x)[5:6])
    rope = attn.rope
    xr = mx.random.normal((2, Hq, 40, D))
    whole = rope(xr, offset=mx.array([7, 7]))
    out["rope: array offsets vs a scalar, one position vs many"] = (
        _same(rope(xr, offset=7), whole)
        and _same(rope(xr[:, :, 20:21], offset=27), whole[:, :, 20:21]))
    logits = mx.random.normal((16, 1000)) * 6
    out["logsumexp: a row alone vs among 16"] = _same(
        mx.logsumexp(logits[3:4], axis=-1), mx.logsumexp(logits, axis=-1)[3:4])
    return out


def check_runs(model, n: int, seeded_too: bool = True, chunks: tuple[int, ...] = (7, 64),
               length: int = 160, accepted: dict | None = None) -> dict[str, str | None]:
    """One request alone, then in each situation: null where identical. `accepted`
    collects each speculative run's accepted drafts per row (the probe, the other)."""
    accepted = {} if accepted is None else accepted
    rng = random.Random(SEED)
    vocab = model.args.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(5, min(vocab, 1000)) for _ in range(length)]

    probe = prompt(length)
    seeded = SeededSampling(temperature=0.8, top_p=0.9, top_k=40, seed=7,
                            presence_penalty=0.5, repetition_penalty=1.1)
    out: dict[str, str | None] = {}
    samplings = [("greedy", None)] + [("seeded top_p/top_k + penalties", seeded)] * seeded_too
    for label, sampling in samplings:
        alone = generate(model, probe, n, sampling=sampling)
        cases = {
            "beside 3 others from the start": dict(companions=(
                Companion(prompt(40)), Companion(prompt(290)), Companion(prompt(7)))),
            "others arriving mid-stream": dict(companions=(
                Companion(prompt(60), at_step=2), Companion(prompt(230), at_step=5))),
            **{f"prefill chunk {n}": dict(prefill_step=n) for n in chunks},
        }
        for name, kw in cases.items():
            out[f"{label}: {name}"] = first_difference(
                alone, generate(model, probe, n, sampling=sampling, **kw))
        cut = length * 5 // 8
        out[f"{label}: from a cached prefix of {cut}"] = first_difference(
            alone, generate(model, probe, n, sampling=sampling,
                            cache=prefix_cache(model, probe, cut), cached=cut))
        k = n // 2
        rest = generate(model, probe + alone.tokens[:k], n - k, sampling=sampling, resumed=k)
        out[f"{label}: resumed at k={k}"] = first_difference(
            alone, Run(alone.tokens[:k] + rest.tokens, alone.rows[:k] + rest.rows))
        # drafts verified in one step (issue 46), beside a row with its own drafts
        other = prompt(70)
        other_alone = generate(model, other, n, sampling=sampling)
        start = prefills(model, [Row(probe, [], 0), Row(other, [], 0)])
        for p in (0.0, 0.5, 1.0):  # the other row's drafts are right half the time
            (mine, theirs), took = verified_runs(
                model, [Row(probe, alone.tokens, p, sampling),
                        Row(other, other_alone.tokens, 0.5, sampling)], start)
            accepted[f"{label}: p={p}"] = took
            out[f"{label}: drafts verified, right with p={p}"] = first_difference(alone, mine)
            out[f"{label}: drafts verified, the row beside it (p={p})"] = \
                first_difference(other_alone, theirs)
            # the engine's step (services/rank/spec_step.py): mlx-lm's BatchGenerator with
            # its decode batch verifying, others drafting random tokens beside it, one
            # arriving and prefilling in chunks meanwhile
            run = generate(model, probe, n, sampling=sampling,
                           prefill_step=7 if length <= 200 else 64,  # a soak's 1100 tokens
                           companions=(Companion(prompt(40)), Companion(prompt(60), at_step=2)),
                           propose=oracle(Row(probe, alone.tokens, p), vocab))
            accepted[f"{label}: engine step, p={p}"] = (run.accepted,)
            out[f"{label}: engine step, drafts verified, right with p={p}"] = \
                first_difference(alone, run)
    return out


def oracle(row: Row, vocab: int):
    """The engine step's test proposer: the probe (uid 0) gets drafts right with the
    row's p; any other row random ones."""
    rng = random.Random(SEED + 2)

    def propose(uid: int, at: int) -> list[int]:
        if uid == 0:
            return drafts_for(rng, row, at, vocab)
        return [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
    return propose


def check_grammar_drafts(model, tokenizer, n: int, accepted: dict) -> dict[str, str | None]:
    """A JSON-schema row verified with drafts (many of them tokens its grammar forbids:
    a wrong draft is a random id) beside a plain row: both equal to their runs alone. The
    grammar's matcher advances only over accepted drafts (each equals a token its mask
    allowed), so a forbidden draft is rejected and never consumed or emitted."""
    eos = sorted(tokenizer.eos_token_ids)
    ctx = SimpleNamespace(eos_ids=eos, grammars=RankGrammars(tokenizer, eos,
                                                               model.args.vocab_size))
    schema = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
              "properties": {"name": {"type": "string"},
                             "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}
    grammar = llg.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    rng = random.Random(SEED + 1)
    probe = [rng.randrange(5, min(model.args.vocab_size, 1000)) for _ in range(90)]
    other = [rng.randrange(5, min(model.args.vocab_size, 1000)) for _ in range(40)]
    shaped = SeededSampling(temperature=0.0, seed=0, grammar=grammar)
    alone = generate(model, probe, n, sampling=shaped, ctx=ctx)
    other_alone = generate(model, other, n)
    out: dict[str, str | None] = {}
    start = prefills(model, [Row(probe, [], 0), Row(other, [], 0)])
    for p in (0.0, 0.5, 1.0):
        (mine, theirs), took = verified_runs(
            model, [Row(probe, alone.tokens, p, shaped, ctx), Row(other, other_alone.tokens, 0.5)],
            start)
        accepted[f"greedy + a JSON schema: p={p}"] = took
        out[f"greedy + a JSON schema: drafts verified, right with p={p}"] = \
            first_difference(alone, mine)
        out[f"greedy + a JSON schema: drafts verified, the row beside it (p={p})"] = \
            first_difference(other_alone, theirs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mode", choices=("on", "off"), required=True)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--greedy-only", action="store_true")
    ap.add_argument("--chunks", default="7,64", help="prefill chunk sizes, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=160)
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    arch = None
    if args.mode == "on":
        arch = determinism.install(model).architecture
    accepted: dict = {}
    runs = check_runs(model, args.tokens, not args.greedy_only,
                      tuple(int(x) for x in args.chunks.split(",")), args.prompt_tokens,
                      accepted)
    runs.update(check_grammar_drafts(model, tokenizer, args.tokens, accepted))
    print(json.dumps({"mode": args.mode, "architecture": arch,
                      "ops": check_ops(model, args.mode), "runs": runs,
                      "accepted": accepted}))


if __name__ == "__main__":
    main()
