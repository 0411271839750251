"""Deterministic, distinct, natural-ish prompts for the serving benchmarks.

Text is built from the embedded model's own corpus vocabulary (models/tinymodel/corpus.py)
with a `random.Random` seeded by a string key, so the same key always gives the same
text, and each text starts with a digest of its key, so texts of different keys part
within their first few tokens: no two prompts share a prefix beyond the chat template
and a word or two, so a prefix cache cannot flatter a "distinct prompts" run. Lengths are counted with the model's own tokenizer.

    tok = load_tokenizer(model_dir)
    text = prose(tok, 800, "gw/bench/c8/t0/r3")      # ~800 tokens of distinct text
    n = chat_prompt_tokens(tok, [{"role": "user", "content": text}])
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

from models.tinymodel.corpus import (
    ANSWERS,
    CONNECTORS,
    OBJECTS,
    PLACES,
    QUESTIONS,
    SUBJECTS,
    VERBS,
)


def load_tokenizer(model_dir: Path | str):
    """The model directory's Hugging Face tokenizer (what both servers load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def count_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def chat_prompt_tokens(tok, messages: list[dict]) -> list[int]:
    """The token ids a server gets for these messages (chat template, generation prompt)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # a BatchEncoding (transformers >= 5), not a list
        out = out["input_ids"]
    return [int(t) for t in out]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    s, v, o, p = (rng.choice(x) for x in (SUBJECTS, VERBS, OBJECTS, PLACES))
    if kind < 0.55:
        line = f"{s.capitalize()} {v} {o} {p}."
        if rng.random() < 0.5:
            s2, v2, o2 = (rng.choice(x) for x in (SUBJECTS, VERBS, OBJECTS))
            line = f"{line[:-1]} {rng.choice(CONNECTORS)} {s2} {v2} {o2}."
        return line
    if kind < 0.7:
        return f"{rng.choice(QUESTIONS)} {rng.choice(ANSWERS)}"
    if kind < 0.85:
        n = rng.randint(2, 9000)
        return f"On day {rng.randint(1, 31)}, {s} {v} {n} items {p}."
    return f"{p.capitalize()}, {s} {v} {o} {rng.choice(CONNECTORS)} {rng.choice(SUBJECTS)} waits."


def prose(tok, n_tokens: int, key: str) -> str:
    """About `n_tokens` tokens (whole sentences, the last one may overshoot a little) of
    text that only `key` determines, starting with a digest of the key."""
    rng = random.Random(key)
    parts = [f"Ref {hashlib.sha256(key.encode()).hexdigest()[:10]}:"]
    count = count_tokens(tok, parts[0])
    while count < n_tokens:
        sentence = _sentence(rng)
        if len(parts) % 6 == 0:
            sentence = "\n\n" + sentence
        parts.append(sentence)
        count += count_tokens(tok, " " + sentence)
    return " ".join(parts)


def log_uniform_lengths(n: int, lo: int, hi: int, key: str) -> list[int]:
    """`n` prompt lengths between lo and hi tokens, log-uniform (many short, some long),
    fixed by `key`."""
    rng = random.Random(key)
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]
