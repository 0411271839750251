"""Rank 0's per-token logprobs (`Tokens.logprobs` / `top_ids` / `top_logprobs`) in
OpenAI's two shapes.

chat:         choices[].logprobs = {"content": [{token, logprob, bytes,
                                                 top_logprobs: [{token, logprob, bytes}]}],
                                    "refusal": null}
completions:  choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: lp}],
                                    text_offset}

A token's string is its own bytes decoded (a byte-level BPE token may hold part of a
UTF-8 character: its `bytes` are exact, its string has U+FFFD there, as vLLM's); a
special token is its added-token text. JSON has no -inf: a logprob below -9999 is sent
as -9999.0, as OpenAI does. Completions' `top_logprobs` maps each alternative's string
to its logprob and always holds the sampled token (so up to k+1 entries, as OpenAI's
legacy API says); `text_offset` counts characters of the token strings from the start
of the completion text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.messages import Tokens
from services.gateway.core.detok import ModelTokenizer

FLOOR = -9999.0


@dataclass(frozen=True)
class Alt:
    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    bytes: list[int]
    logprob: float
    top: list[Alt]


def _lp(x: float) -> float:
    return FLOOR if not math.isfinite(x) or x < FLOOR else x


def token_text(tok: ModelTokenizer, token_id: int) -> tuple[str, list[int]]:
    """One token's string and bytes (memoised per tokenizer)."""
    memo: dict[int, tuple[str, list[int]]] = tok.__dict__.setdefault("_token_texts", {})
    hit = memo.get(token_id)
    if hit is not None:
        return hit
    table = tok.token_bytes()
    raw = table[token_id] if table is not None and 0 <= token_id < len(table) else None
    if raw:  # byte-level: the token's exact bytes
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
    else:  # a special token (b"" in the table), or not a byte-level tokenizer
        text = tok.decode([token_id]) if raw is None else ""
        if not text:
            text = str(tok.hf.convert_ids_to_tokens(token_id) or "")
        hit = (text, list(text.encode()))
    memo[token_id] = hit
    return hit


def from_body(tok: ModelTokenizer, b: Tokens) -> list[TokenLogprob]:
    """The entries of one chunk, aligned with its tokens."""
    out = []
    for i, t in enumerate(b.tokens[:len(b.logprobs)]):
        text, raw = token_text(tok, t)
        ids = b.top_ids[i] if i < len(b.top_ids) else []
        lps = b.top_logprobs[i] if i < len(b.top_logprobs) else []
        top = [Alt(*token_text(tok, a), _lp(lp)) for a, lp in zip(ids, lps, strict=False)]
        out.append(TokenLogprob(text, raw, _lp(b.logprobs[i]), top))
    return out


def chat(entries: list[TokenLogprob]) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                         "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                                           "bytes": a.bytes} for a in e.top]}
                        for e in entries],
            "refusal": None}


class CompletionShaper:
    """Completions' shape; keeps the text offset across a stream's chunks."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        offsets, tops = [], []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.token)
            top = {a.token: a.logprob for a in e.top}
            top.setdefault(e.token, e.logprob)
            tops.append(top)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": offsets}
