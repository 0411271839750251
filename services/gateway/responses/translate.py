"""Responses requests (validated by responses/schemas.py) → the internal request
(internal_request.py), and the shared path's errors renamed back to the Responses parameters.

Translation (as vLLM's shim does, peer notes C): `instructions` → a system message
first; input items in order → chat messages (message items by role, `function_call`
items → the assistant's `tool_calls`, `function_call_output` → `role: "tool"`,
`reasoning` items → the next assistant turn's `reasoning_content`; a `function_call`
with a `namespace` → a call of the qualified name, responses/tools.py); a
`previous_response_id` prepends the stored conversation (its input and output items,
not its instructions); function and namespace `tools` → chat tools; `tool_choice` → chat's;
`text.format` → `response_format` (the same grammar path); `max_output_tokens` →
`max_completion_tokens`; `reasoning.effort` → the template's `reasoning_effort`, or
`enable_thinking` for a model with a thinking mode (`apply_reasoning`).
"""

from __future__ import annotations

from common import request_params
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import (
    NO_LOGPROBS,
    ChatInput,
    GenerationRequest,
    JsonObject,
    turn,
)
from services.gateway.responses.schemas import ResponsesRequest, bad
from services.gateway.responses.tools import chat_tools, forced_name, qualified


def _text(content: str | list[JsonObject]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


def chat_messages(items: list[JsonObject], instructions: str | None) -> list[JsonObject]:
    """Responses input items (validated) → OpenAI chat messages, in order."""
    out: list[JsonObject] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []

    def assistant() -> JsonObject:
        """The assistant turn a call or reasoning joins: the last message if it is an
        assistant's that has not been answered yet, else a new one."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": None})
        msg = out[-1]
        if reasoning:
            msg["reasoning_content"] = (msg.get("reasoning_content") or "") + "".join(reasoning)
            reasoning.clear()
        return msg

    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            if item["role"] == "assistant":
                if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                    prev = out[-1]
                    prev["content"] = (prev["content"] or "") + _text(item["content"])
                else:
                    out.append({"role": "assistant", "content": _text(item["content"])})
                assistant()
            else:
                out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "reasoning":
            reasoning.append("".join(p.get("text") or "" for p in item.get("content") or [])
                             or "".join(p.get("text") or "" for p in item.get("summary") or []))
        elif kind == "function_call":
            msg = assistant()
            ns = item.get("namespace")
            msg.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": qualified(ns, item["name"]) if ns else item["name"],
                             "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item["output"])})
    return out


def input_items(req: ResponsesRequest) -> list[JsonObject]:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [dict(i) for i in req.input]


def to_internal(req: ResponsesRequest, history: list[JsonObject]) -> GenerationRequest:
    """The internal request; `history`: the stored conversation before this input."""
    tc = req.tool_choice
    choice: str | JsonObject | None = None
    if tc is not None:
        choice = tc if isinstance(tc, str) else {
            "type": "function", "function": {"name": forced_name(req.tools, tc["name"])}}
    parallel = False if req.max_tool_calls == 1 else req.parallel_tool_calls
    fmt = req.text.format if req.text else None
    rf: JsonObject | None = None
    if fmt is not None and fmt.type == "json_schema":
        rf = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": bool(fmt.strict),
            **({"description": fmt.description} if fmt.description else {})}}
    elif fmt is not None:
        rf = {"type": fmt.type}
    messages = [turn(**m) for m in chat_messages([*history, *input_items(req)], req.instructions)]
    if not messages:
        raise bad("input", "no input items and no instructions: nothing to answer")
    return GenerationRequest(
        model=req.model, input=ChatInput(messages, chat_tools(req.tools) if req.tools else None),
        tool_choice=choice, parallel_tool_calls=parallel, response_format=rf,
        max_tokens=req.max_output_tokens,
        params=request_params.given(req, request_params.RESPONSES),
        logprobs=(req.top_logprobs or 0) if req.wants_logprobs() else NO_LOGPROBS)


def apply_reasoning(internal: GenerationRequest, req: ResponsesRequest,
                    tok: ModelTokenizer) -> GenerationRequest:
    """`reasoning.effort`, which only the model can answer: its template's
    `reasoning_effort`, else its thinking mode on or off; no thinking mode → 400."""
    effort = req.reasoning.effort if req.reasoning else None
    if effort is None:
        return internal
    fmt = tok.fmt
    if "reasoning_effort" in fmt.template_vars:
        return internal.with_input(reasoning_effort=effort)
    if fmt.has_thinking:
        return internal.with_input(template_kwargs={"enable_thinking": effort != "none"})
    if effort != "none":
        raise bad("reasoning", f"model {tok.path.name} has no thinking mode (its template emits "
                  "no reasoning markers); omit reasoning or send effort 'none'",
                  "unsupported_value")
    return internal


# OpenAI chat parameter names in the shared path's errors → the Responses request's names.
PARAM_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
               ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort"),
               ("chat_template_kwargs", "reasoning"), ("tool_choice.function.name", "tool_choice.name"),
               ("max_completion_tokens", "max_output_tokens"), ("messages", "input"))


def renamed(e: ApiError) -> ApiError:
    """The error with its parameter named as the Responses request spells it."""
    p = e.param
    if p is None:
        return e
    new = p
    if p.startswith("tools.") and p.endswith(".function.parameters"):
        new = p[: -len(".function.parameters")] + ".parameters"
    for old, to in PARAM_NAMES:
        if p == old or p.startswith(old + "."):
            new = to + p[len(old):]
            break
    if new != p:
        e.message = f"{new}: {e.message.replace(repr(p), repr(new))}"
        e.param = new
    return e

