"""One internal request for every API (issue 42 item 2): the same question asked through
chat, Messages and Responses translates into equal GenerationRequests, so the prompt,
the grammar, sampling and the rank's work cannot depend on the API it came through. And
nothing on the path from a route to rank 0 is typed `Any`."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from services.gateway.anthropic import schemas as anthropic_schemas
from services.gateway.anthropic import translate as anthropic_translate
from services.gateway.core.internal_request import ChatInput, GenerationRequest
from services.gateway.openai import schemas as openai_schemas
from services.gateway.openai import translate as openai_translate
from services.gateway.responses import schemas as responses_schemas
from services.gateway.responses import translate as responses_translate

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ARGS = '{"a": 7}'
PARAMS = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.05, "seed": 11}


def chat() -> GenerationRequest:
    body = {"model": "m", "max_tokens": 50, "tool_choice": "required",
            "parallel_tool_calls": False, **PARAMS,
            "tools": [{"type": "function", "function": {
                "name": "add", "description": "adds", "parameters": SCHEMA}}],
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "add 7"},
                {"role": "assistant", "content": "calling", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "7"},
                {"role": "user", "content": "and again"}]}
    req = openai_schemas.validate(openai_schemas.ChatRequest, json.dumps(body).encode())
    return openai_translate.from_chat(req)


def messages() -> GenerationRequest:
    body = {"model": "m", "max_tokens": 50, "system": "You are terse.", **PARAMS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [{"name": "add", "description": "adds", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "add 7"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 7}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "7"},
                    {"type": "text", "text": "and again"}]}]}
    req = anthropic_schemas.validate(json.dumps(body).encode(), anthropic_schemas.CREATE)
    return anthropic_translate.to_internal(req)


def responses() -> GenerationRequest:
    body = {"model": "m", "max_output_tokens": 50, "instructions": "You are terse.",
            "tool_choice": "required", "parallel_tool_calls": False, **PARAMS,
            "tools": [{"type": "function", "name": "add", "description": "adds",
                       "parameters": SCHEMA}],
            "input": [
                {"type": "message", "role": "user", "content": "add 7"},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "calling"}]},
                {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "call_1", "output": "7"},
                {"type": "message", "role": "user", "content": "and again"}]}
    req = responses_schemas.validate(json.dumps(body).encode())
    return responses_translate.to_internal(req, [])


def test_the_same_question_through_chat_messages_and_responses_is_one_internal_request():
    c, m, r = chat(), messages(), responses()
    assert isinstance(c.input, ChatInput) and len(c.input.messages) == 5
    assert c.params == PARAMS and c.max_tokens == 50 and c.tool_choice == "required"
    assert m == c
    assert r == c


# The modules a request passes through from its route to rank 0: none may say `Any`.
PATH = ("core/internal_request", "openai/translate", "anthropic/translate",
        "responses/translate", "core/request_path", "core/prompts", "core/sampling_params",
        "core/structured")


def _any_annotations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        args = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            notes = [x.annotation for x in args] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        else:
            continue
        for note in filter(None, notes):
            if any(isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(note)):
                out.append(f"{path.name}:{note.lineno}")
    return out


def test_nothing_on_the_path_from_route_to_rank_is_typed_any():
    gateway = ROOT / "services" / "gateway"
    found = [hit for name in PATH for hit in _any_annotations(gateway / f"{name}.py")]
    assert found == [], found
