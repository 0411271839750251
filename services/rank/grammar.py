"""Grammar-constrained decoding on a rank: one llguidance matcher per request.

The gateway compiles `response_format` / a required tool call into a serialized
llguidance grammar (services/gateway/core/structured.py); the plan carries it verbatim
(`PlanInsert.sampling.grammar`). Every rank builds the same matcher from the same grammar
and the same tokenizer, and advances it with the same sampled tokens, so every rank
applies the same mask at the same step (DESIGN 5.6) without shipping masks in plans: the
matcher is deterministic (no clocks, no randomness; its resource limits count work, not
time).

The mask is a logits processor for mlx-lm's `BatchGenerator`, called once per generated
token with the tokens so far (prompt, then each sampled token) and that step's logits.
The first call is for the first generated token; every later call first feeds the
matcher the token sampled at the previous step (`tokens[-1]`). Disallowed tokens get
−inf. When the grammar is complete (the matcher is stopped: nothing more may follow),
or the matcher is in error, only EOS is allowed, so the request stops.

`RankGrammars` holds the rank's llguidance tokenizer, built once on the first grammar
request (~0.1-1 s; most deployments never need it), and the compiled grammars by text.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance as llg
import llguidance.hf
import mlx.core as mx
import numpy as np

log = logging.getLogger("lockstep.rank.grammar")

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
MAX_COMPILED = 32  # grammars kept compiled per rank (a repeated schema compiles once)


class GrammarCompileError(ValueError):
    """The grammar does not compile against this model's tokenizer (llguidance's text)."""


def hf_tokenizer_of(tokenizer: Any) -> Any:
    """The transformers tokenizer inside mlx-lm's TokenizerWrapper (or itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


class RankGrammars:
    """This rank's llguidance tokenizer and compiled grammars (main thread only)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int], vocab_size: int) -> None:
        self._hf = hf_tokenizer_of(tokenizer)
        self.eos_ids = sorted(int(t) for t in eos_ids)
        self.vocab_size = int(vocab_size)  # the logits' width (may exceed the tokenizer's)
        self._lt: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._eos_only: mx.array | None = None

    @property
    def lltokenizer(self) -> llg.LLTokenizer:
        if self._lt is None:
            # EOS as the engine's stop tokens: the token a finished grammar allows is
            # one BatchGenerator stops on.
            try:
                self._lt = llguidance.hf.from_tokenizer(self._hf, eos_token=self.eos_ids or None)
            except ValueError as exc:  # not a fast (Rust) tokenizer
                raise GrammarCompileError(f"this model's tokenizer cannot be used: {exc}") \
                    from None
        return self._lt

    def compile(self, grammar: str) -> llg.LLMatcher:
        """A fresh matcher for `grammar`; raises GrammarCompileError."""
        m = self._compiled.get(grammar)
        if m is None:
            m = llg.LLMatcher(self.lltokenizer, grammar, log_level=0)
            if m.is_error():
                raise GrammarCompileError(m.get_error())
            self._compiled[grammar] = m
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return m.deep_copy()

    def check(self, grammar: str) -> str | None:
        """Why `grammar` cannot be used on this rank, or None (rank 0 asks before planning)."""
        try:
            self.compile(grammar)
        except GrammarCompileError as exc:
            return str(exc)
        return None

    def processor(self, grammar: str) -> GrammarProcessor:
        """The logits processor of one request. A grammar that does not compile here
        (rank 0 refused it already, so this is a bug) raises: the plan cannot be applied."""
        return GrammarProcessor(self.compile(grammar), self)

    def eos_only(self) -> mx.array:
        if self._eos_only is None:
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[[t for t in self.eos_ids if t < self.vocab_size]] = True
            self._eos_only = mx.array(allowed)
        return self._eos_only


class GrammarProcessor:
    """Masks one request's logits with its matcher; see the module docstring."""

    def __init__(self, matcher: llg.LLMatcher, grammars: RankGrammars) -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.calls = 0
        n = grammars.lltokenizer.vocab_size
        self._words = np.full((n + 31) // 32, -1, dtype=np.int32)
        self._n = min(n, grammars.vocab_size)

    @property
    def done(self) -> bool:
        """Only EOS may follow: the grammar is complete, or the matcher failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def allowed(self) -> mx.array:
        """The next token's mask over the logits' width (True: allowed)."""
        if self.done:
            return self.grammars.eos_only()
        # Bit i of word i//32 is token i; unpacked in O(vocab) numpy, no Python loop.
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        allowed = np.zeros(self.grammars.vocab_size, dtype=bool)
        allowed[:self._n] = bits[:self._n]
        return mx.array(allowed)

    def advance(self, token: int) -> None:
        if token in self.grammars.eos_ids:
            return  # the request ends on it (mlx-lm still computes one step ahead)
        if not self.matcher.consume_token(token):
            # The mask forbade it, so only a bug gets here; every rank is in the same
            # state, and the next mask ends the request.
            log.warning("grammar matcher failed on token %d: %s", token,
                        self.matcher.get_error())

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.calls:
            self.advance(int(tokens[-1].item()))  # the previous step's sample
        self.calls += 1
        if self.done and not self.grammars.eos_ids:
            return logits  # nothing can end it: max_tokens will
        return mx.where(self.allowed(), logits, -mx.inf)
