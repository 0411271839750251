"""Anthropic Messages requests, validated (anthropic/schemas.py), into the one internal
request (internal_request.py), so generation is never written twice.

Translation (as vLLM's and llama.cpp's shims do, peer notes D): `system` → a system
message; text blocks → content; `tool_use` blocks → the assistant's `tool_calls`;
`tool_result` blocks → `role: "tool"` messages; `thinking` blocks → the assistant's
`reasoning_content`; `tools` → function tools; `tool_choice` auto/any/tool/none → auto /
required / a named function / none (`disable_parallel_tool_use` → parallel_tool_calls
false); `output_config.format` → `response_format` json_schema (the same grammar path);
`output_config.effort` → `reasoning_effort`; `thinking` → `chat_template_kwargs`
`enable_thinking`; `stop_sequences` → `stop`.
"""

from __future__ import annotations

import json

from common import request_params
from services.gateway.anthropic.schemas import (
    BILLING_LINE,
    CountTokensRequest,
    MessagesRequest,
    bad,
)
from services.gateway.core.internal_request import (
    ChatInput,
    GenerationRequest,
    Json,
    JsonObject,
    function_tool,
    stop_list,
    turn,
)


def _text(content: str | list[JsonObject] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.get("text") or "" for b in content)


def system_text(text: str) -> str:
    """The system prompt without Claude Code's per-request billing line."""
    if BILLING_LINE not in text:
        return text
    return "\n".join(ln for ln in text.split("\n") if not ln.startswith(BILLING_LINE)).strip("\n")


def chat_messages(req: CountTokensRequest) -> list[JsonObject]:
    """Anthropic turns → OpenAI chat messages, in order."""
    out: list[JsonObject] = []
    if req.system is not None:
        sys_text = system_text(req.system if isinstance(req.system, str)
                               else "".join(b.text for b in req.system))
        if sys_text:
            out.append({"role": "system", "content": sys_text})
    keep = thinking_kept(req)
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content if m.role != "system"
                        else system_text(m.content)})
            continue
        if m.role == "assistant":
            msg: JsonObject = {"role": "assistant", "content": ""}
            calls, thinking = [], []
            for b in m.content:
                kind = b["type"]
                if kind == "text":
                    msg["content"] += b["text"]
                elif kind == "thinking":
                    thinking.append(b["thinking"])
                elif kind == "tool_use":
                    calls.append({"id": b["id"], "type": "function", "function": {
                        "name": b["name"], "arguments": _json(b["input"])}})
            if calls:
                msg["tool_calls"] = calls
                msg["content"] = msg["content"] or None
            if thinking and id(m) in keep:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
            continue
        out += _user_turn(m.role, m.content)
    return out


def thinking_kept(req: CountTokensRequest) -> set[int]:
    """The assistant turns (by id) whose thinking blocks stay in the prompt: all of them,
    unless a context_management clear_thinking edit keeps only the last N with any."""
    with_thinking = [m for m in req.messages if m.role == "assistant"
                     and isinstance(m.content, list)
                     and any(b.get("type") == "thinking" for b in m.content)]
    kept = [e.turns_kept() for e in (req.context_management.edits
                                     if req.context_management else [])]
    n = min((k for k in kept if k is not None), default=None)
    if n is not None:
        with_thinking = with_thinking[-n:]
    return {id(m) for m in with_thinking}


def _user_turn(role: str, blocks: list[JsonObject]) -> list[JsonObject]:
    """A user (or system) turn's blocks: text runs as messages of that role, each
    tool_result as a `tool` message, in their order."""
    out: list[JsonObject] = []
    text: list[str] = []
    for b in blocks:
        if b["type"] == "text":
            text.append(b["text"])
            continue
        if text:
            out.append({"role": role, "content": "".join(text)})
            text = []
        body = _text(b.get("content"))
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": ("Error: " + body) if b.get("is_error") else body})
    if text:
        out.append({"role": role, "content": "".join(text)})
    return out


def _json(obj: Json) -> str:
    return json.dumps(obj, ensure_ascii=False)


def to_internal(req: CountTokensRequest) -> GenerationRequest:
    """The internal request (already valid: built from a validated one)."""
    tools = [function_tool(t.name, t.input_schema, t.description) for t in req.tools or []]
    tc = req.tool_choice
    choice: str | JsonObject | None = None
    if tc is not None:
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
    oc = req.output_config
    rf: JsonObject | None = None
    if oc is not None and oc.format is not None:
        rf = {"type": "json_schema", "json_schema": {
            "name": "output_config.format", "schema": oc.format.schema_, "strict": True}}
    th = req.thinking
    kwargs: JsonObject = ({"enable_thinking": th.type == "enabled"}
                          if th is not None and th.type != "adaptive" else {})
    messages = [turn(**m) for m in chat_messages(req)]
    if not messages:  # every turn empty, no system prompt: as Anthropic, a 400
        raise bad("messages", "no message has any content: nothing to answer")
    inp = ChatInput(messages, tools or None, kwargs, oc.effort if oc is not None else None)
    create = isinstance(req, MessagesRequest)
    return GenerationRequest(
        model=req.model, input=inp, tool_choice=choice, response_format=rf,
        parallel_tool_calls=False if tc is not None and tc.disable_parallel_tool_use else None,
        max_tokens=req.max_tokens if create else None,
        stops=stop_list(req.stop_sequences) if create else (),
        params=request_params.given(req, request_params.MESSAGES) if create else {})
