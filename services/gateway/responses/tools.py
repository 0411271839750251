"""Responses tools: `function` tools and OpenAI's `namespace` tools (function tools
grouped under one name: Codex sends its sub-agent tools as the `multi_agent_v1`
namespace), validated, and offered to a chat template that knows only flat functions.

A namespaced function is offered to the model as one chat function named
`<namespace>__<name>` (SEP): `__` is a word character, so it survives every mlx-lm tool
parser (pythonic, mistral and function_gemma read names as `\\w`/`[\\w-]` only; a `.`
would not) and OpenAI's own function-name alphabet. Its description is the namespace's
description, then its own, so the model sees what the group is for. Both ways:

- a call of `<namespace>__<name>` comes back as a `function_call` item (and its streamed
  events) with `name` the inner name and `namespace` the group's, as OpenAI's;
- an input `function_call` item with a `namespace` is the call of the qualified name.

A qualified name that equals another tool's name is a 400 naming the namespace, so a
call maps back to exactly one tool. Hosted tools (`web_search`, `file_search`, ...) need
OpenAI's servers: a 400 naming them, with the client setting that drops them where one
is known (HOSTED_HINTS).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import JsonObject, function_tool

SEP = "__"
MAX_NAME = 256  # a function's name as the model sees it (chat's bound too)
# How a known client stops sending a hosted tool (keyed by the tool's type).
HOSTED_HINTS = {
    "web_search": " Codex sends it unless web search is off: run it with "
                  "`-c web_search=disabled` (config.toml: web_search = \"disabled\").",
}


class _M(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class FunctionTool(_M):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None  # harmless: every tool is in the prompt


class NamespaceTool(_M):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str
    tools: list[FunctionTool] = Field(min_length=1)


Tool = FunctionTool | NamespaceTool
KINDS: dict[str, type[_M]] = {"function": FunctionTool, "namespace": NamespaceTool}


def qualified(namespace: str, name: str) -> str:
    """The name the model sees for function `name` of `namespace`."""
    return f"{namespace}{SEP}{name}"


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _loc(exc: ValidationError, prefix: str) -> tuple[str, str]:
    first = exc.errors()[0]
    parts = [str(p) for p in first.get("loc", ())]
    return ".".join([prefix, *parts]), first.get("msg", "invalid")


def check(tools: Any, max_tools: int) -> None:
    """The request's raw `tools` (a list, else left to the schema): each a function or a
    namespace of functions, no two reaching the model under one name, at most
    `max_tools` functions once namespaces are flattened. A 400 names the first fault."""
    if not isinstance(tools, list):
        return
    plain: set[str] = set()  # repeated plain names: as chat treats them
    offered: dict[str, tuple[int, str]] = {}  # a namespaced function's name → (i, namespace)
    count = 0
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        cls = KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            hint = HOSTED_HINTS.get(kind, "") if isinstance(kind, str) else ""
            raise _bad(f"tools.{i}.type", f"tool type {kind!r} is not available here (function "
                       f"and namespace tools only: hosted tools run on OpenAI's servers).{hint}",
                       "unsupported_value")
        if cls is NamespaceTool:
            for j, inner in enumerate(t.get("tools") or []):
                ikind = inner.get("type") if isinstance(inner, dict) else None
                if ikind != "function":
                    raise _bad(f"tools.{i}.tools.{j}.type", f"tool type {ikind!r} inside a "
                               "namespace is not available here (function tools only)",
                               "unsupported_value")
        try:
            tool = cls.model_validate(t)
        except ValidationError as exc:
            param, msg = _loc(exc, f"tools.{i}")
            raise _bad(param, msg) from None
        if isinstance(tool, FunctionTool):
            plain.add(tool.name)
            count += 1
            continue
        for j, f in enumerate(tool.tools):
            name = qualified(tool.name, f.name)
            if len(name) > MAX_NAME:  # the model sees one name: bounded as a function's
                raise _bad(f"tools.{i}.tools.{j}.name", f"namespace {tool.name!r} offers "
                           f"{name[:40]!r}... ({len(name)} characters, namespace{SEP}name) "
                           f"to the model; at most {MAX_NAME}")
            if name in offered:
                raise _bad(f"tools.{i}.name", f"namespace {tool.name!r} offers {name!r} to the "
                           f"model (namespace{SEP}name), as tools.{offered[name][0]} does")
            offered[name] = (i, tool.name)
        count += len(tool.tools)
    for name, (i, ns) in offered.items():
        if name in plain:
            raise _bad(f"tools.{i}.name", f"namespace {ns!r} offers {name!r} to the model "
                       f"(namespace{SEP}name), which is also a function tool's name")
    if count > max_tools:
        raise _bad("tools", f"{count} function tools once namespaces are counted; at most "
                   f"{max_tools} per request", "too_many_items")


def chat_tools(tools: list[Tool]) -> list[JsonObject]:
    """Chat function tools, namespaces flattened (qualified names, the namespace's
    description first)."""
    out = []
    for t in tools:
        group = [t] if isinstance(t, FunctionTool) else t.tools
        for f in group:
            name, desc = f.name, f.description
            if isinstance(t, NamespaceTool):
                name = qualified(t.name, f.name)
                desc = "\n\n".join(d for d in (t.description, f.description) if d)
            out.append(function_tool(name, f.parameters, desc, f.strict))
    return out


def namespaced(tools: list[Tool] | None) -> dict[str, tuple[str, str]]:
    """Qualified name → (namespace, inner name), for every namespaced function."""
    return {qualified(t.name, f.name): (t.name, f.name)
            for t in tools or [] if isinstance(t, NamespaceTool) for f in t.tools}


def forced_name(tools: list[Tool] | None, name: str) -> str:
    """The chat function a `tool_choice` `{type: function, name}` forces: a plain
    function of that name, else the one namespaced function of it (its `tool_choice`
    has no namespace); none, or several namespaces' → 400 naming `tool_choice.name`."""
    if any(isinstance(t, FunctionTool) and t.name == name for t in tools or []):
        return name
    hits = {q: ns for q, (ns, inner) in namespaced(tools).items() if inner == name}
    if len(hits) == 1:
        return next(iter(hits))
    if hits:
        raise _bad("tool_choice.name", f"{name!r} is a function of several namespaces "
                   f"({', '.join(hits.values())}): which one to force is ambiguous")
    raise _bad("tool_choice.name", f"{name!r} is not one of the tools")
