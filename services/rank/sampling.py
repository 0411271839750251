"""Per-request samplers that never touch MLX's global random state.

mlx-lm's temperature/top-p samplers read and write the global `mx.random` state, which
differs per process: one extra draw on one rank and the ranks feed different tokens into
the next step (DESIGN 5.6). Here every sampled token uses its own key, derived from the
request's seed (carried in the plan's Sampling record) and the token's index in the
completion, so every rank draws the same token whatever else it sampled, and the same
seed reproduces.

Greedy requests return None: BatchGenerator then uses its one shared argmax sampler,
which it applies to the whole batch in a single call.

Logits processors (`logits_processors_for`: logit_bias, then the repetition penalty,
then presence/frequency penalties; a grammar mask, then XTC, may follow) are each a pure
function of (the tokens so far, the logits), built from the plan's insert alone (its
Sampling record, prompt and `resumed`), so every rank computes the same logits from the
same tokens; XTC's coin is keyed like the sampler's draw, never MLX's global state. BatchGenerator calls a request's processors once per step
with its token context (prompt and the tokens generated so far, as fed to the model) and
its row of logits, before the log-softmax the sampler and `logprobs` see. The order
after temperature scaling is vLLM's: min_p, then top_k, then top_p.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from common import request_params
from common.messages import PlanInsert, Sampling, SeededSampling
from common.request_params import BIAS_LIMIT, MAX_TOP_LOGPROBS, SEED_MOD
from services.rank.grammar import RankGrammars

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (tokens so far, logits)
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """A 64-bit seed for token `index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ (index & MASK64))


def top_k_filter(logprobs: mx.array, k: int) -> mx.array:
    """Keep the k largest (ties at the k-th: argpartition's pick), the rest -inf."""
    if not 0 < k < logprobs.shape[-1]:
        return logprobs
    drop = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-math.inf, logprobs.dtype), axis=-1)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """Drop tokens less likely than min_p × the most likely one (the top one stays)."""
    if not 0.0 < min_p <= 1.0:
        return logprobs
    floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logprobs < floor, mx.array(-math.inf, logprobs.dtype), logprobs)


def draw(s: SeededSampling, logprobs: mx.array, index: int) -> mx.array:
    """Token `index` of a request sampled with `s` (temperature > 0) from its logprobs
    row(s): the one draw plain decoding and a verified draft at that index share."""
    scaled = logprobs * (1.0 / s.temperature)
    if 0.0 < s.min_p <= 1.0:
        scaled = min_p_filter(scaled, s.min_p)
    if s.top_k > 0:
        scaled = top_k_filter(scaled, s.top_k)
    if 0.0 < s.top_p < 1.0:
        scaled = apply_top_p(scaled, s.top_p)
    return mx.random.categorical(scaled, key=mx.random.key(token_seed(s.seed, index)))


class SeededSampler:
    """One request's sampler: token `index` drawn with `draw`. Called once per generated
    token, in order, on every rank alike (graph construction is deterministic), so
    `index` is the next token's position; a verify step (services/rank/spec_step.py)
    draws several positions at once and moves `index` past them."""

    def __init__(self, sampling: SeededSampling, start: int) -> None:
        self.sampling, self.index = sampling, start

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.index += 1
        return draw(self.sampling, logprobs, self.index - 1)


def make_sampler(s: SeededSampling, start: int = 0) -> SeededSampler | None:
    """The sampler for one request; None means greedy (the batch's shared argmax).
    `start`: the index of its first token (a continuation goes on where it stopped)."""
    if s.temperature <= 0.0:
        return None
    return SeededSampler(s, start)


def sampler_for(ins: PlanInsert) -> Sampler | None:
    return make_sampler(ins.sampling, start=ins.resumed)


# -- logits processors ------------------------------------------------------------------


class ProcessorContext(Protocol):
    """What a processor may need from the engine beyond the insert (the engine itself
    is passed; a processor that needs more names it here)."""

    eos_ids: list[int]
    grammars: RankGrammars | None  # the rank's llguidance matchers (services/rank/grammar.py)


def make_logit_bias(bias: dict[int, float]) -> LogitsProcessor:
    """OpenAI's logit_bias: a constant added to chosen tokens' logits."""
    ids = mx.array(sorted(bias), dtype=mx.int32)
    values = mx.array([bias[t] for t in sorted(bias)], dtype=mx.float32)

    def add_bias(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, ids].add(values.astype(logits.dtype))

    return add_bias


def make_repetition_penalty(penalty: float, context_size: int) -> LogitsProcessor:
    """mlx-lm's and vLLM's sign-aware penalty (a positive logit divided by it, a negative
    one multiplied) for each id among the last `context_size` tokens, prompt included.
    mlx-lm's own writes into its argument; this one returns a new array. Gather and
    scatter touch only those tokens' logits; a repeated id is written the same value."""

    def penalize(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.shape[0] == 0:
            return logits
        recent = tokens[-context_size:][None, :]
        sel = mx.take_along_axis(logits, recent, axis=-1)
        sel = mx.where(sel < 0, sel * penalty, sel / penalty)
        return mx.put_along_axis(logits, recent, sel, axis=-1)

    return penalize


def make_output_penalties(presence: float, frequency: float,
                          prompt_len: int) -> LogitsProcessor:
    """OpenAI's presence and frequency penalties, over the generated tokens only (as
    vLLM and OpenAI: the prompt is not penalised): logit -= frequency × count +
    presence × (count > 0). `tokens[prompt_len:]` are the generated ones: the context
    holds the whole prompt (a prefix-cache hit passes the cached part as all_tokens)."""

    def penalize(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.shape[0] <= prompt_len:  # shapes are known without evaluating
            return logits
        out = tokens[prompt_len:][None, :]
        if frequency:  # a scatter-add: once per occurrence
            logits = logits.at[:, out[0]].subtract(mx.array(frequency, logits.dtype))
        if presence:  # a scatter-set: a repeated id gets the same value, once
            sel = mx.take_along_axis(logits, out, axis=-1) - mx.array(presence, logits.dtype)
            logits = mx.put_along_axis(logits, out, sel, axis=-1)
        return logits

    return penalize


XTC_SALT = 0x5854435F434F494E  # the XTC coin's key: apart from the sampler's own draw


def xtc_filter(logits: mx.array, threshold: float, special: mx.array | None,
               coin: mx.array, probability: float) -> mx.array:
    """mlx-lm's `apply_xtc` with the coin given: when coin <= probability, every token
    whose probability exceeds `threshold`, except the least likely of them, is set to
    -inf (none if fewer than two exceed it); `special` ids are never excluded."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    above = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > above
    if special is not None:
        mask[..., special] = False
    return mx.where(coin > probability, logits,
                    mx.where(mask, mx.array(-math.inf, logits.dtype), logits))


def make_xtc(probability: float, threshold: float, special: list[int], seed: int,
             prompt_len: int) -> LogitsProcessor:
    """XTC as a processor, its coin drawn from (seed, token index) rather than MLX's
    global state (mlx-lm's): every rank draws the same coin, and a resumed or re-run
    request the same one at the same token. The index is that of the token being chosen:
    the tokens so far less the client's prompt (`prompt_len`: a continuation's resumed
    tokens are output, so they count), as the sampler's `index`. The eos ids are never
    excluded (mlx_lm.server spares them too)."""
    special_ids = mx.array(sorted(set(special)), dtype=mx.int32) if special else None

    def exclude(tokens: mx.array, logits: mx.array) -> mx.array:
        index = tokens.shape[0] - prompt_len  # shapes are known without evaluating
        coin = mx.random.uniform(key=mx.random.key(token_seed(seed ^ XTC_SALT, index)))
        return xtc_filter(logits, threshold, special_ids, coin, probability)

    return exclude


def logits_processors_for(ins: PlanInsert, ctx: ProcessorContext) -> list[LogitsProcessor]:
    """Every processor of one request, in order: the one place they are built. An empty
    list costs BatchGenerator nothing for that row."""
    s = ins.sampling
    out: list[LogitsProcessor] = []
    if s.logit_bias:
        out.append(make_logit_bias({b.token: b.bias for b in s.logit_bias}))
    if s.repetition_penalty != 1.0:
        out.append(make_repetition_penalty(s.repetition_penalty, s.repetition_context_size))
    if s.presence_penalty or s.frequency_penalty:
        # a continuation's resumed tokens are output: penalised as they were before
        out.append(make_output_penalties(s.presence_penalty, s.frequency_penalty,
                                         len(ins.prompt) - ins.resumed))
    if s.grammar:  # a disallowed token stays -inf whatever came before (XTC only adds -inf)
        if ctx is None or ctx.grammars is None:
            raise ValueError("a grammar needs the rank's tokenizer (Engine grammars)")
        proc = ctx.grammars.processor(s.grammar)
        for token in ins.prompt[len(ins.prompt) - ins.resumed:]:  # where the request was
            proc.advance(token)
        out.append(proc)
    if s.xtc_probability > 0.0 and s.temperature > 0.0:  # as mlx-lm: never when greedy
        # after the grammar: it excludes only among allowed tokens and always keeps one
        out.append(make_xtc(s.xtc_probability, s.xtc_threshold, list(ctx.eos_ids),
                            s.seed, len(ins.prompt) - ins.resumed))
    return out


# -- rank 0: checking a GENERATE's sampling record ------------------------------------


def _finite_in(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def sampling_problem(s: Sampling, vocab_size: int) -> str | None:
    """Why rank 0 refuses a GENERATE's sampling record (text for people), or None. The
    grammar is checked apart: compiling it needs the rank's tokenizer (leader.validate)."""
    if not 0 <= s.seed < SEED_MOD:  # the sender drew it (the gateway: request_path.py)
        return "seed must be in [0, 2^63)"
    for p in request_params.WIRE:  # the declared ranges, as the gateway checked them
        if (why := request_params.problem(p.name, getattr(s, p.name))) is not None:
            return why
    seen: set[int] = set()
    for b in s.logit_bias:
        if not 0 <= b.token < vocab_size:
            return f"logit_bias token id {b.token} out of range [0, {vocab_size})"
        if b.token in seen:
            return f"logit_bias names token {b.token} twice"
        seen.add(b.token)
        if not _finite_in(b.bias, -BIAS_LIMIT, BIAS_LIMIT):
            return f"logit_bias for token {b.token} must be in [-100, 100]"
    return None


def top_logprobs_problem(k: int) -> str | None:
    """Why rank 0 refuses a GENERATE's `top_logprobs` (not sampling: it reports), or None."""
    if not -1 <= k <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (-1: none)"
    return None
