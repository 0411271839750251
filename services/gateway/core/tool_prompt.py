"""Tools for a model whose chat template has none (SmolLM2, the default model, is one).

Such a template never reads `tools`, and prints only each message's `content`: passed
through, the tool list would vanish from the prompt without a word (a silent no-op), and
an assistant turn that called a tool (content null) or a tool result would make the
template fail. So for these models the gateway writes the tools and the tool turns into
the messages itself, in the Hermes / Qwen2.5 convention that mlx-lm's `json_tools` parser
reads back — as llama.cpp's server does with its generic format for templates without
tool support:

- the tool list, with how to call one, is appended to the system message (one is added
  first when the conversation has none);
- an assistant turn's calls become `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  text after its content;
- tool results become a user turn of `<tool_response>` blocks (consecutive results, one
  turn, as Qwen2.5's template does).

The model's output is parsed with `json_tools`, and tool_choice "required" or a named
function constrains it to that wrapper (services/gateway/core/structured.py), as for a model
whose template has it. The format is chosen in chat_format.load_format.
"""

from __future__ import annotations

import json
from typing import Any

START, END = "<tool_call>", "</tool_call>"  # mlx_lm.tool_parsers.json_tools's markers

_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
           "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_FOOTER = ("</tools>\n\nFor each function call, return a json object with function name and "
           "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
           '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_text(tools: list[dict]) -> str:
    """The system prompt's tool section: one JSON line per tool, as the client sent it."""
    lines = [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join([_HEADER, *lines, _FOOTER])


def call_text(call: dict[str, Any]) -> str:
    """One earlier call (an OpenAI `tool_calls` entry) as the model would have written it."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # not JSON: shown as the string the client sent
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def fold(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` (template dicts) with the tools and the tool turns written as text."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        d = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        d["content"] = content
        out.append(d)
    for d in out:
        d.pop("_results", None)
    if tools:
        section = tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] \
                else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
