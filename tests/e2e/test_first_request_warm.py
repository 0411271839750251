"""Issue 30 item 4: what the first request needs is warmed before ready (no timing here;
the bench measures: bench/first_request.py).

- Each rank runs the warm-up generation after the load, before it reports ready, and
  names what it warmed in its log; the engine's batch is untouched by it (uids still
  start at 0, so the first plan's insert is uid 0 on every rank).
- The gateway renders the chat template before a tokenizer counts as "loaded", which
  /ready requires.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from common.rankspec import RankSettings
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.tokenizers import Tokenizers, warm
from services.rank.warmup import DECODE_STEPS, ROWS, WarmReport
from tests.e2e.rank_harness import Deployment, model_dir

WARMED = ("warmed: prefill 2 rows (1x40, 1x8); decode batch 2 x 1 step; samplers greedy, "
          "temperature+top_p+top_k+min_p, penalties, logit_bias")


@pytest.mark.parametrize("mode", ["single", "pp"])
def test_every_rank_names_the_warmed_shapes_before_it_is_ready(tmp_path, mode):
    with Deployment(tmp_path, mode=mode) as d:
        r = d.generate([1, 2, 3, 4], max_tokens=4)  # the first plan after the warm-up
        assert r.finish_reason == "length" and len(r.tokens) == 4, r
        for rank in range(d.world):
            text = d.log(rank)
            assert WARMED in text, text[-2000:]
            assert text.index(WARMED) < text.index(f"rank {rank} phase ready"), text[-2000:]
            assert not re.search(r"Divergence|loading or the warm-up failed", text), text


def test_the_warm_up_leaves_the_engine_as_it_found_it():
    from mlx_lm import load

    from services.rank.engine import Engine
    from services.rank.warmup import warm_up

    model, tok = load(str(model_dir()))
    engine = Engine(model, sorted(tok.eos_token_ids), RankSettings())
    report = warm_up(model, engine, RankSettings(), vocab=tok.vocab_size)
    assert report.prefill == ROWS and report.decode_batch == 2
    assert report.decode_steps == DECODE_STEPS and report.line().startswith(WARMED)
    assert engine.next_uid == 0 and engine.step == 0 and not engine.has_work()
    assert engine.gen.insert([[1, 2, 3]]) == [0]  # its generator was never used


def test_report_line_names_kernels_only_when_some_were_built():
    r = WarmReport((40, 8), 2, 3, ("greedy",), 0, 0.5)
    assert r.line() == ("warmed: prefill 2 rows (1x40, 1x8); decode batch 2 x 3 steps; "
                        "samplers greedy; in 0.50s")
    assert "; 3 MLX CPU kernels built; in" in WarmReport((40,), 1, 3, ("g",), 3, 1).line()


def test_gateway_tokenizer_is_loaded_only_with_its_chat_template_rendered():
    path = str(model_dir())

    async def main() -> tuple[str, object]:
        toks = Tokenizers()
        toks.want(path)
        assert toks.state(path) == "loading" and toks.warmed(path) is None
        await toks.get(path, "d-1")
        state, warmed = toks.state(path), toks.warmed(path)
        toks.close()
        return state, warmed

    state, warmed = asyncio.run(main())
    tok = load_tokenizer(path)
    expected = len(tok.chat_prompt([{"role": "user", "content": "What is the capital of "
                                     "France?"}], None))
    assert state == "loaded" and warmed is not None
    assert warmed.chat_template and warmed.prompt_tokens == expected


def test_warm_without_a_chat_template_encodes(monkeypatch):
    loaded = load_tokenizer(model_dir())
    tok = dataclasses.replace(loaded, fmt=dataclasses.replace(loaded.fmt, wrapper=None))
    monkeypatch.setattr(tok.hf, "chat_template", None, raising=False)
    w = warm(tok)
    assert not w.chat_template and w.prompt_tokens == len(tok.encode("What is the capital "
                                                                      "of France?"))
