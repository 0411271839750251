"""The gateway's grammars for structured output (services/gateway/core/structured.py), with the
embedded model's tokenizer: each request shape gives the grammar the ranks will compile,
text that obeys it is accepted to the end, and every schema llguidance cannot compile is
a 400 naming the field it came from."""

from __future__ import annotations

import json
from dataclasses import replace

import llguidance as llg
import pytest

from services.gateway.core import structured
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import GenerationRequest
from services.gateway.openai.schemas import ChatRequest
from services.gateway.openai.translate import from_chat
from services.rank.grammar import RankGrammars
from tests.e2e.rank_harness import model_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 16}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(model_dir())


@pytest.fixture(scope="module")
def ranks(tok):
    return RankGrammars(tok.hf, tok.eos_ids, len(tok.hf))


def chat(**kw) -> GenerationRequest:
    return from_chat(ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}))


def accepts(ranks: RankGrammars, tok, grammar: str, text: str) -> bool:
    """The whole of `text` is allowed and completes the grammar (only EOS may follow)."""
    m = ranks.compile(grammar)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def refused(req: GenerationRequest, tok) -> ApiError:
    with pytest.raises(ApiError) as e:
        structured.grammar_for(req, tok)
    assert e.value.status == 400
    return e.value


def test_no_constraint_no_grammar(tok):
    assert structured.grammar_for(chat(), tok) == ""
    assert structured.grammar_for(chat(response_format={"type": "text"}), tok) == ""
    assert structured.grammar_for(chat(tools=[WEATHER], tool_choice="auto"), tok) == ""


def test_json_object_and_json_schema(tok, ranks):
    g = structured.grammar_for(chat(response_format={"type": "json_object"}), tok)
    assert accepts(ranks, tok, g, '{"a": [1, "x"], "b": {}}')
    assert not accepts(ranks, tok, g, '[1, 2]')
    assert not accepts(ranks, tok, g, '{"a":1}')  # one layout: ", " and ": "
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for strict in (True, False, None):  # enforced whatever strict says (vLLM)
        g = structured.grammar_for(chat(response_format={
            "type": "json_schema", "json_schema": {"name": "num", "schema": schema,
                                                   "strict": strict}}), tok)
        assert accepts(ranks, tok, g, '{"n": 42}')
        assert not accepts(ranks, tok, g, '{"n": "42"}')


@pytest.mark.parametrize("schema, needle", [
    ({"type": "nope"}, "Invalid type"),
    ({"type": "object", "if": {"type": "object"}}, "if"),  # unimplemented: never ignored
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
])
def test_a_schema_that_does_not_compile_is_a_400_naming_it(tok, schema, needle):
    e = refused(chat(response_format={"type": "json_schema",
                                      "json_schema": {"name": "thing", "schema": schema}}), tok)
    assert e.param == "response_format.json_schema.schema" and e.code == "invalid_json_schema"
    assert "'thing'" in e.message and needle in e.message
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    e = refused(chat(tools=[WEATHER, bad_tool], tool_choice="required"), tok)
    assert e.param == "tools.1.function.parameters" and "'f'" in e.message


@pytest.mark.parametrize("rf, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"kind": "json_object"}, "response_format"),
])
def test_malformed_response_format_names_the_field(tok, rf, param):
    assert refused(chat(response_format=rf), tok).param == param


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_required_tool_call_is_the_templates_wrapper_with_valid_arguments(tok, ranks):
    g = structured.grammar_for(chat(tools=[WEATHER, CLOCK], tool_choice="required"), tok)
    assert accepts(ranks, tok, g, call("get_weather", {"city": "Oslo"}))
    assert accepts(ranks, tok, g, call("get_time", {}))  # no parameters: {} only
    assert accepts(ranks, tok, g, call("get_time", {}) + "\n" + call("get_weather", {"city": "x"}))
    assert not accepts(ranks, tok, g, call("get_weather", {"town": "Oslo"}))
    assert not accepts(ranks, tok, g, call("get_time", {"x": 1}))
    assert not accepts(ranks, tok, g, call("send_mail", {}))
    assert not accepts(ranks, tok, g, "Sure! " + call("get_time", {}))
    one = structured.grammar_for(chat(tools=[WEATHER, CLOCK], tool_choice="required",
                                      parallel_tool_calls=False), tok)
    m = ranks.compile(one)
    ids = tok.encode(call("get_time", {}))
    assert m.try_consume_tokens(ids) == len(ids) and m.is_stopped()  # then EOS only


def test_named_function(tok, ranks):
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = structured.grammar_for(chat(tools=[WEATHER, CLOCK], tool_choice=named), tok)
    assert accepts(ranks, tok, g, call("get_weather", {"city": "Oslo"}))
    assert not accepts(ranks, tok, g, call("get_time", {}))
    e = refused(chat(tools=[WEATHER], tool_choice={"type": "function",
                                                   "function": {"name": "nope"}}), tok)
    assert e.param == "tool_choice.function.name"


def test_tool_choice_refusals(tok):
    assert refused(chat(tool_choice="required"), tok).param == "tool_choice"  # no tools
    e = refused(chat(tools=[WEATHER], tool_choice="required",
                     response_format={"type": "json_object"}), tok)
    assert e.param == "response_format"
    # A model whose tool-call format is not the JSON wrapper: refused, never unconstrained.
    other = replace(tok, path=tok.path / "mistral-like")
    structured._formats[str(other.path)] = "mistral"
    assert refused(chat(tools=[WEATHER], tool_choice="required"), other).param == "tool_choice"


def test_a_grammar_over_the_wire_bound_is_refused(tok):
    big = {"type": "object", "properties": {f"p{i:05d}": {"type": "integer"} for i in range(12000)}}
    e = refused(chat(response_format={"type": "json_schema",
                                      "json_schema": {"name": "big", "schema": big}}), tok)
    assert "too large" in e.message and e.param == "response_format.json_schema.schema"


def test_the_grammar_compiles_identically_on_a_rank(tok, ranks):
    g = structured.grammar_for(chat(tools=[WEATHER], tool_choice="required"), tok)
    assert llg.LLMatcher.validate_grammar(g, ranks.lltokenizer) == ""
    assert ranks.check(g) is None
