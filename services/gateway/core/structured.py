"""Structured output: `response_format` and a required tool call → one llguidance grammar.

The grammar travels to every rank as text (`Generate.sampling.grammar`, a serialized
llguidance grammar), where each rank masks its logits with the same matcher
(services/rank/grammar.py). Here it is built and compiled once against the model's own tokenizer,
exactly as the ranks will, so a schema llguidance cannot compile is a 400 naming it
before anything is sent.

- `response_format` `{"type": "json_object"}`: any JSON object; `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`: a JSON value valid for `schema`
  (enforced whatever `strict` says, as vLLM does); `{"type": "text"}`: nothing.
- `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` with
  `tools`: the output is the model's own tool-call wrapper — the Qwen / mlx-lm
  `json_tools` form `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  which the gateway's parser reads — with `arguments` valid for that tool's
  `parameters`. "required": one call of any offered tool, or several one per line
  unless `parallel_tool_calls` is false; a named function: exactly one call of it.
  A model with another (or no) mlx-lm tool-call format gets a 400 naming tool_choice:
  no grammar here would make it emit a call its parser reads.

JSON is generated compact and in one layout (`", "` and `": "`, no free whitespace):
with free whitespace a weak or random model can emit newlines until max_tokens.
Keywords llguidance does not implement are a 400, never silently ignored.
"""

from __future__ import annotations

import json
import threading

import llguidance as llg
import llguidance.hf

from common.messages import GRAMMAR
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import (
    GenerationRequest,
    JsonObject,
    tool_name,
    tool_parameters,
)

MAX_GRAMMAR = GRAMMAR["max_len"]  # the wire's bound for Generate.sampling.grammar
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# The one mlx-lm tool-call format constrained here: a JSON {"name", "arguments"} between
# its markers (mlx_lm.tool_parsers.json_tools; Qwen2.5, Hermes and the embedded model).
WRAPPER_FORMAT = "json_tools"
BAD_SCHEMA = "invalid_json_schema"

_lock = threading.Lock()
_lltok: dict[str, llg.LLTokenizer] = {}
_formats: dict[str, str | None] = {}


def lltokenizer(tok: ModelTokenizer) -> llg.LLTokenizer:
    """llguidance's view of the model's tokenizer, built once per model (~0.1-1 s)."""
    key = str(tok.path)
    with _lock:
        lt = _lltok.get(key)
        if lt is None:
            try:
                lt = llguidance.hf.from_tokenizer(tok.hf, eos_token=sorted(tok.eos_ids) or None)
            except ValueError as exc:  # not a fast (Rust) tokenizer
                raise ApiError(400, f"constrained decoding needs a fast tokenizer: {exc}",
                               code="unsupported_value") from None
            _lltok[key] = lt
        return lt


def tool_format(tok: ModelTokenizer) -> str | None:
    """The mlx-lm tool parser of this model, chosen as mlx_lm.tokenizer_utils.load does:
    the tokenizer config's `tool_parser_type`, else inferred from the template or vocab;
    json_tools for a template without tools, whose calls the gateway writes in that form."""
    if tok.fmt.gateway_tools:
        return WRAPPER_FORMAT
    key = str(tok.path)
    with _lock:
        if key not in _formats:
            from mlx_lm.tokenizer_utils import _infer_tool_parser

            named = getattr(tok.hf, "init_kwargs", {}).get("tool_parser_type")
            _formats[key] = named or _infer_tool_parser(tok.hf)
        return _formats[key]


def _compile_check(grammar: str, tok: ModelTokenizer, param: str, what: str) -> None:
    if len(grammar) > MAX_GRAMMAR:
        raise ApiError(400, f"{what} is too large: its grammar has {len(grammar)} characters, "
                       f"at most {MAX_GRAMMAR}", param=param, code=BAD_SCHEMA)
    err = llg.LLMatcher.validate_grammar(grammar, lltokenizer(tok))
    if err:
        raise ApiError(400, f"{what} cannot be compiled for constrained decoding: {err}",
                       param=param, code=BAD_SCHEMA)


def json_grammar(schema: JsonObject, tok: ModelTokenizer, param: str, what: str) -> str:
    try:
        g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise ApiError(400, f"{what} is not a JSON schema: {exc}", param=param,
                       code=BAD_SCHEMA) from None
    _compile_check(g, tok, param, what)
    return g


def response_format_grammar(rf: JsonObject | None, tok: ModelTokenizer) -> str:
    """The grammar for a chat request's `response_format` ("" for text or none)."""
    if rf is None:
        return ""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(400, "response_format must be an object with a string 'type'",
                       param="response_format", code="invalid_value")
    kind = rf["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_grammar(ANY_OBJECT, tok, "response_format", "response_format json_object")
    if kind != "json_schema":
        raise ApiError(400, f"response_format type {kind!r}: expected 'text', 'json_object' or "
                       "'json_schema'", param="response_format.type", code="invalid_value")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(400, "response_format json_schema needs a 'json_schema' object "
                       "({name, schema, strict})", param="response_format.json_schema",
                       code="invalid_value")
    name = js.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise ApiError(400, "response_format.json_schema.name must be a string of 1-64 "
                       "characters", param="response_format.json_schema.name",
                       code="invalid_value")
    if "strict" in js and not isinstance(js["strict"], bool | None):
        raise ApiError(400, "response_format.json_schema.strict must be a boolean",
                       param="response_format.json_schema.strict", code="invalid_value")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, f"response_format json_schema {name!r} has no 'schema' object",
                       param="response_format.json_schema.schema", code="invalid_value")
    return json_grammar(schema, tok, "response_format.json_schema.schema",
                        f"the schema of response_format {name!r}")


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _wrapper_piece(text: str, tok: ModelTokenizer, lt: llg.LLTokenizer) -> str:
    """`text` as a lark item: the special token itself when the model has one (llguidance
    matches a special token only by name), else the literal text."""
    tid = tok.hf.get_added_vocab().get(text)
    if tid is not None and lt.is_special_token(tid):
        return text  # lark's <token> syntax
    return _lark_str(text)


def tool_call_grammar(tools: list[JsonObject], choice: str | JsonObject,
                      parallel: bool | None, tok: ModelTokenizer) -> str:
    """The grammar for tool_choice "required" / a named function (validated tools)."""
    fmt = tool_format(tok)
    if fmt != WRAPPER_FORMAT:
        raise ApiError(400, f"tool_choice {'required' if choice == 'required' else 'function'}: "
                       f"this model's tool-call format ({fmt}) cannot be constrained here; "
                       "use tool_choice 'auto'", param="tool_choice", code="unsupported_value")
    names = [tool_name(t) for t in tools]
    if isinstance(choice, str):  # "required"
        picked = list(range(len(tools)))
    else:
        fn = choice["function"]
        name = fn["name"] if isinstance(fn, dict) else None
        if name not in names:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not in tools",
                           param="tool_choice.function.name", code="invalid_value")
        picked = [names.index(name)]
    lt = lltokenizer(tok)
    from mlx_lm.tool_parsers import json_tools

    open_ = _wrapper_piece(json_tools.tool_call_start, tok, lt)
    close = _wrapper_piece(json_tools.tool_call_end, tok, lt)
    tail = _lark_str("}\n")
    rules = []
    for i in picked:
        fn_name = names[i]
        given = tool_parameters(tools[i])
        params = NO_PARAMETERS if given is None else given
        param = f"tools.{i}.function.parameters"
        json_grammar(params, tok, param, f"the parameters of tool {fn_name!r}")  # names it
        head = _lark_str('\n{"name": ' + json.dumps(fn_name, ensure_ascii=False)
                         + ', "arguments": ')
        rules.append(f"call_{i}: {open_} {head} args_{i} {tail} {close}")
        rules.append(f"args_{i}: %json {json.dumps({**params, 'x-guidance': JSON_LAYOUT})}")
    call = " | ".join(f"call_{i}" for i in picked)
    one = choice != "required" or parallel is False
    start = f"start: call\ncall: {call}" if one else f'start: call ("\\n" call)*\ncall: {call}'
    g = llg.LLMatcher.grammar_from_lark(start + "\n" + "\n".join(rules) + "\n")
    _compile_check(g, tok, "tools", "the tool-call grammar")
    return g


def grammar_for(req: GenerationRequest, tok: ModelTokenizer) -> str:
    """The request's grammar ("" : unconstrained). CPU-bound: run it off the loop."""
    choice, tools, rf = req.tool_choice, req.tools(), req.response_format
    constrained_tools = choice == "required" or isinstance(choice, dict)
    if constrained_tools:
        if not tools:
            raise ApiError(400, "tool_choice 'required' or a named function needs tools",
                           param="tool_choice", code="invalid_value")
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise ApiError(400, "response_format cannot be combined with tool_choice 'required' "
                           "or a named function", param="response_format",
                           code="invalid_value")
        return tool_call_grammar(tools, choice, req.parallel_tool_calls, tok)
    return response_format_grammar(rf, tok)
