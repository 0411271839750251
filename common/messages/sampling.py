"""How a request's tokens are chosen: the one record GENERATE (`Generate.sampling`) and
a plan's insert (`PlanInsert.sampling`) share, so the fields are declared once.

What is in it: what every rank applies alike when it picks the next token
(services/rank/sampling.py) — the sampler (temperature, top_p, top_k, min_p), its
per-token keys (seed), the logits processors (logit_bias, the repetition, presence and
frequency penalties, repetition_context_size) and the grammar mask (`grammar`: every rank
compiles the same text and masks the same logits, so it shapes the choice as logit_bias
does). What is not: `top_logprobs` (what rank 0 reports about a choice; rank 0 alone
reads it, followers send no tokens), `resumed` (which of the prompt's tokens are the
request's own output so far: a fact about the prompt, read beside this record), and
stop_token_ids / max_tokens (when to stop, not what to pick). Each default means "off":
greedy, no filter, no penalty, no bias, no grammar.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.messages.base import BIAS_LIST, GRAMMAR


@dataclass
class TokenBias:
    """OpenAI's `logit_bias` entry: `bias` added to token `token`'s logit every step."""

    token: int
    bias: float


@dataclass(kw_only=True)
class Sampling:
    """A GENERATE's. Its sender decides the seed, once: the gateway draws one at admission
    for a request that names none (services/gateway/core/request_path.py); 0 where it cannot
    matter (the canary is greedy). Rank 0 checks the values (services/rank/sampling.py
    `sampling_problem`, the ranges of common/request_params.py; the gateway checks them
    first)."""

    temperature: float = 0.0  # 0: greedy (the batch's shared argmax)
    top_p: float = 1.0
    seed: int = 0  # in [0, 2^63): every rank derives each token's key from it
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    xtc_probability: float = 0.0  # XTC (services/rank/sampling.py make_xtc): 0 is off
    xtc_threshold: float = 0.1
    logit_bias: list[TokenBias] = field(default_factory=list, metadata=BIAS_LIST)
    # A serialized llguidance grammar ("": none), built and checked by the gateway
    # (services/gateway/core/structured.py), compiled on every rank.
    grammar: str = field(default="", metadata=GRAMMAR)
    # False: rank 0 proposes no drafts for it, whatever the deployment's --speculative
    speculative: bool = True

    def seeded(self, seed: int) -> SeededSampling:
        """This record as a plan carries it: `seed` as given, logit_bias in token order."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(seed=seed, logit_bias=sorted(self.logit_bias, key=lambda b: b.token))
        return SeededSampling(**values)


@dataclass(kw_only=True)
class SeededSampling(Sampling):
    """A plan's: the seed is required on the wire, so every rank derives the same keys;
    a PLAN whose insert has none fails the schema."""

    seed: int = field()
