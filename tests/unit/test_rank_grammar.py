"""Grammar-constrained decoding on a rank (services/rank/grammar.py), with the embedded
model's real tokenizer: compile errors are typed, the mask is llguidance's, a finished
grammar allows only EOS, two ranks' matchers agree mask for mask, and mlx-lm's
BatchGenerator drives the processor as the module says (the random-weight model's
output validates against the schema)."""

from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import mlx.core as mx
import numpy as np
import pytest

from services.rank.grammar import GrammarCompileError, RankGrammars
from tests.e2e.rank_harness import model_dir

LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}


@pytest.fixture(scope="module")
def loaded():
    from mlx_lm import load

    return load(str(model_dir()))


@pytest.fixture(scope="module")
def vocab(loaded) -> int:
    return int(loaded[0].args.vocab_size)


def grammars(loaded, vocab: int, extra: int = 0) -> RankGrammars:
    tok = loaded[1]
    return RankGrammars(tok, sorted(tok.eos_token_ids), vocab + extra)


def schema_grammar(schema: dict) -> str:
    return llg.LLMatcher.grammar_from_json_schema(schema, defaults=LAYOUT)


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def test_a_grammar_that_does_not_compile_is_a_typed_error(loaded, vocab):
    rg = grammars(loaded, vocab)
    bad = [schema_grammar({"type": "nope"}), llg.LLMatcher.grammar_from_lark("start: undefined_rule"),
           llg.LLMatcher.grammar_from_lark("start: <no_such_special_token>")]
    for g in bad:
        with pytest.raises(GrammarCompileError):
            rg.compile(g)
        assert rg.check(g)  # rank 0's refusal carries llguidance's text
    assert rg.check(schema_grammar(SCHEMA)) is None


def test_the_mask_allows_exactly_the_grammar_prefixes(loaded, vocab):
    rg = grammars(loaded, vocab, extra=7)  # logits wider than the tokenizer (padded vocab)
    tok = loaded[1]
    proc = rg.processor(llg.LLMatcher.grammar_from_lark('start: "yes" | "no"'))
    out = as_np(proc(mx.array([1, 2, 3]), mx.zeros((1, vocab + 7))))[0]
    allowed = np.nonzero(np.isfinite(out))[0]
    assert len(allowed) > 0 and not np.isfinite(out[vocab:]).any()
    for t in allowed:
        piece = tok.decode([int(t)])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    for word in ("yes", "no"):  # the tokenizer's own first token of each word is allowed
        assert tok.encode(word, add_special_tokens=False)[0] in set(allowed.tolist())


def test_a_finished_grammar_allows_only_eos(loaded, vocab):
    rg = grammars(loaded, vocab)
    tok = loaded[1]
    proc = rg.processor(llg.LLMatcher.grammar_from_lark('start: "yes"'))
    ids = tok.encode("yes", add_special_tokens=False)
    logits = mx.array(np.random.default_rng(0).normal(size=(1, vocab)).astype(np.float32))
    context = [7, 8]
    proc(mx.array(context), logits)  # the first call consumes nothing
    for t in ids:
        context.append(t)
        out = as_np(proc(mx.array(context), logits))[0]
    assert proc.done
    assert sorted(np.nonzero(np.isfinite(out))[0].tolist()) == sorted(rg.eos_ids)


def test_a_failed_matcher_ends_the_request_with_eos(loaded, vocab):
    rg = grammars(loaded, vocab)
    tok = loaded[1]
    proc = rg.processor(llg.LLMatcher.grammar_from_lark('start: "yes"'))
    proc(mx.array([1]), mx.zeros((1, vocab)))
    wrong = tok.encode("no", add_special_tokens=False)[0]  # not allowed: only a bug feeds it
    out = as_np(proc(mx.array([1, wrong]), mx.zeros((1, vocab))))[0]
    assert proc.matcher.is_error()
    assert sorted(np.nonzero(np.isfinite(out))[0].tolist()) == sorted(rg.eos_ids)


def drive(rg: RankGrammars, grammar: str, vocab: int, seed: int, steps: int = 120):
    """Argmax over seeded random logits through the processor, as a rank would."""
    rng = np.random.default_rng(seed)
    proc = rg.processor(grammar)
    context, out, masks = [5, 6, 7], [], []
    for _ in range(steps):
        masked = as_np(proc(mx.array(context), mx.array(rng.normal(size=(1, vocab)),
                                                         dtype=mx.float32)))[0]
        masks.append(np.isfinite(masked))
        t = int(np.argmax(masked))
        if t in rg.eos_ids:
            return out, masks, True
        out.append(t)
        context.append(t)
    return out, masks, False


def test_two_ranks_apply_the_same_masks_and_the_output_validates(loaded, vocab):
    tok = loaded[1]
    g = schema_grammar(SCHEMA)
    a, b = grammars(loaded, vocab), grammars(loaded, vocab)  # two ranks' own instances
    for seed in range(3):
        out_a, masks_a, ended = drive(a, g, vocab, seed)
        out_b, masks_b, _ = drive(b, g, vocab, seed)
        assert ended, tok.decode(out_a)
        assert out_a == out_b and all((x == y).all() for x, y in zip(masks_a, masks_b, strict=True))
        jsonschema.validate(json.loads(tok.decode(out_a)), SCHEMA)


def test_batch_generator_drives_the_processor(loaded, vocab):
    """mlx-lm calls it once per generated token with the prompt and the tokens so far;
    the random-weight model, constrained, emits schema-valid JSON and stops on EOS."""
    from mlx_lm.generate import BatchGenerator

    model, tok = loaded
    eos = sorted(tok.eos_token_ids)
    rg = grammars(loaded, vocab)
    prompt = tok.apply_chat_template([{"role": "user", "content": "A person, as JSON."}],
                                     add_generation_prompt=True)
    proc = rg.processor(schema_grammar(SCHEMA))
    seen: list[list[int]] = []

    def spy(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.tolist())
        return proc(tokens, logits)

    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], max_tokens=200)
    gen.insert([prompt], max_tokens=[200], logits_processors=[[spy]])
    out, finish = [], None
    while finish is None:
        for r in gen.next()[1]:
            finish = r.finish_reason
            if finish != "stop":
                out.append(r.token)
    assert finish == "stop"
    # First call: the prompt; each later one: the tokens so far, the last one sampled at
    # the step before (the EOS too: mlx-lm computes one step ahead of what it returns).
    assert seen[0] == prompt
    assert [c[len(prompt):] for c in seen[1:]] == [out[:k] for k in range(1, len(out) + 1)] \
        + [out + [seen[-1][-1]]]
    assert seen[-1][-1] in eos
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
