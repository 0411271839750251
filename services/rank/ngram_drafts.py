"""Prompt-lookup drafts (issue 46, item 1): what follows a request's latest tokens, guessed
from where the same n-gram occurred before in its prompt or its own output. No model:
an edit returns most of the file it was given, a tool loop re-quotes what it read.

Rank 0 keeps one `NgramIndex` per speculating request. The longest suffix of the tokens
so far (at most `max_n` tokens, at least `min_n`) that occurred earlier with something
after it proposes the up to k tokens that followed its latest earlier occurrence (the
latest: a request repeating itself is likelier to repeat what it said last). Each gram
maps to the position after its latest occurrence, updated as tokens arrive, so a
proposal costs a dictionary lookup per n, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2  # a single shared token is weak evidence (to be tuned by `make bench`)


class NgramIndex:
    def __init__(self, tokens: Iterable[int] = (), *, max_n: int = DEFAULT_MAX_N,
                 min_n: int = DEFAULT_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # gram -> index after its latest use
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # the grams ending just before t now have a successor
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._after[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to k drafts for the tokens after the current ones ([] if no gram matched)."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._after.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (a continuation rebuilt on another launch
        starts from what the stream delivered)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._after = [], {}
            self.extend(kept)
