"""Gateway text pipeline: incremental detokenizer, stop strings, request validation
(tool calls and reasoning: test_output_parser.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.stops import StopMatcher
from services.gateway.openai.schemas import ChatRequest, CompletionRequest, validate


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny"))


TEXTS = ["plain ascii text", "naïve café — 東京 🚀 ok", "emoji 👩‍👩‍👧 and ünïcödé", "a\nb\tc  d"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_token_by_token_never_splits_utf8(tok, text):
    ids = tok.encode(text)
    d = tok.detokenizer()
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


@pytest.mark.timeout(60)
def test_detokenizer_chunks_and_invalid_bytes(tok):
    text = "東京 and 🚀 again"
    ids = tok.encode(text)
    d = tok.detokenizer()
    out = d.add(ids[:3]) + d.add(ids[3:7]) + d.add(ids[7:]) + d.flush()
    assert out == text
    # bytes that never form a character are emitted as U+FFFD, not held forever
    lone = [t for t in range(len(tok.hf)) if tok.decode([t]) == "\ufffd"][:1]
    assert lone, "a byte-level BPE vocabulary has lone non-ASCII byte tokens"
    d = tok.detokenizer()
    got = "".join(d.add(lone) for _ in range(8)) + d.flush()
    assert got == "\ufffd" * 8


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc XYZ", max_size=40), stops=st.lists(
    st.text(alphabet="abc XYZ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 6), max_size=30))
def test_stop_matcher_equals_whole_string_cut(text, stops, cuts):
    m = StopMatcher(stops)
    out, i = [], 0
    for c in cuts + [len(text)]:
        out.append(m.feed(text[i:i + c]))
        i += c
        if i >= len(text):
            break
    out.append(m.flush())
    # the first stop string to complete wins (ties: the longest), as generation would stop
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[:min(hits)[1]] if hits else text
    assert "".join(out) == expected
    assert m.stopped == bool(hits)


def _err(cls, body) -> ApiError:
    with pytest.raises(ApiError) as ei:
        validate(cls, json.dumps(body).encode() if not isinstance(body, bytes) else body)
    return ei.value


def test_validation_errors_name_the_parameter():
    msgs = [{"role": "user", "content": "hi"}]
    assert _err(ChatRequest, b"{").code == "invalid_json"
    assert _err(ChatRequest, [1]).code == "invalid_json"
    assert _err(ChatRequest, {"model": "m"}).param == "messages"
    assert _err(ChatRequest, {"model": "m", "messages": msgs, "max_tokens": 0}).param == "max_tokens"
    assert _err(ChatRequest, {"model": "m", "messages": msgs, "temperature": 3}).param == "temperature"
    assert _err(ChatRequest, {"model": "m", "messages": msgs, "stream": "yes"}).param == "stream"
    assert _err(ChatRequest, {"model": "m", "messages": msgs, "n": 17}).param == "n"
    assert _err(ChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}).code == "unsupported_value"
    assert _err(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"
    r = validate(ChatRequest, json.dumps({"model": "m", "messages": msgs, "max_completion_tokens": 5,
                                          "max_tokens": 9, "stop": "x"}).encode())
    assert r.limit() == 5 and r.stops() == ["x"]
    c = validate(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3], "seed": -4}')
    assert c.prompt == [1, 2, 3] and c.seed == -4


def test_incomplete_utf8_tail_is_exact(tok):
    from services.gateway.core.detok import incomplete_utf8_tail

    assert incomplete_utf8_tail("東".encode()[:2]) and incomplete_utf8_tail(b"ab\xf0\x9f\x9a")
    assert not incomplete_utf8_tail("東".encode()) and not incomplete_utf8_tail(b"abc")
    assert not incomplete_utf8_tail(b"\x80") and not incomplete_utf8_tail(b"\xe6a")
    table = tok.token_bytes()
    assert table is not None  # the embedded tokenizer is byte-level BPE
    cont = table.index(b"\x80")  # a lone continuation byte can never complete: no wait
    lead = table.index(b"\xe6")  # a lead byte may: held until the character is whole
    d = tok.detokenizer()
    assert d.add([cont]) == "\ufffd"
    assert d.add([lead]) == ""
    assert d.add([table.index(b"\x9d"), table.index(b"\xb1")]) == "東"


@pytest.mark.timeout(60)
def test_a_model_without_a_chat_template_is_a_400_not_a_500(tmp_path):
    import shutil

    from services.gateway.core.prompts import prompt_ids

    src = build_model(tmp_path / "src", preset="tiny")
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    from services.gateway.openai.translate import from_chat, from_completion

    req = ChatRequest.model_validate({"model": "bare", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ApiError) as err:
        prompt_ids(from_chat(req), load_tokenizer(bare), 8)
    assert err.value.status == 400 and err.value.param == "messages"
    assert "no chat template" in str(err.value)
    # completions still work on it
    p = prompt_ids(from_completion(CompletionRequest.model_validate(
        {"model": "bare", "prompt": "hi"})), load_tokenizer(bare), 8)
    assert p.ids


def test_token_limit_is_capped_by_the_context_and_the_wire():
    from common.envelope import Key, Signer
    from common.messages import Generate
    from services.gateway.core.prompts import MAX_TOKENS, token_limit

    assert token_limit(None, 512, 8192, 100) == 512  # the gateway's default
    assert token_limit(10**20, 512, 8192, 100) == 8092  # what the context leaves
    assert token_limit(10**20, 512, None, 100) == MAX_TOKENS  # no stated context
    assert token_limit(7, 512, None, 100) == 7
    # what it gives always packs (an int beyond int64 would not: a 500)
    with pytest.raises(TypeError):  # the 500 a top_k of 10**20 gave
        Signer(Key.from_secret(b"k" * 32), "gw").encode(
            Generate(request_id="r", prompt=[1], max_tokens=10**20))
    Signer(Key.from_secret(b"k" * 32), "gw").encode(Generate(request_id="r", prompt=[1], max_tokens=MAX_TOKENS))
