"""Per-request samplers that never touch MLX's global random state.

mlx-lm's temperature/top-p samplers read and write the global `mx.random` state, which
differs per process: one extra draw on one rank and the ranks feed different tokens into
the next step (DESIGN 5.6). Here every sampled token uses its own key, derived from the
request's seed (carried in the plan) and the token's index in the completion, so every
rank draws the same token whatever else it sampled, and the same seed reproduces.

Greedy requests return None: BatchGenerator then uses its one shared argmax sampler,
which it applies to the whole batch in a single call.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

Sampler = Callable[[mx.array], mx.array]
MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """A 64-bit seed for token `index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ (index & MASK64))


def make_sampler(temperature: float, top_p: float, seed: int) -> Sampler | None:
    """The sampler for one request; None means greedy (the batch's shared argmax)."""
    if temperature <= 0.0:
        return None
    inv_t = 1.0 / temperature
    use_top_p = 0.0 < top_p < 1.0
    index = 0

    def sample(logprobs: mx.array) -> mx.array:
        # Called once per generated token, in order, on every rank alike (graph
        # construction is deterministic), so `index` is the token's position.
        nonlocal index
        key = mx.random.key(token_seed(seed, index))
        index += 1
        scaled = logprobs * inv_t
        if use_top_p:
            scaled = apply_top_p(scaled, top_p)
        return mx.random.categorical(scaled, key=key)

    return sample
