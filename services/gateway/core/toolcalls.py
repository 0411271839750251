"""Tool calls: the body between a model's tool-call markers, parsed by that model's own
mlx-lm parser (chat_format.py), then validated here.

A body becomes tool calls only if the parser accepts it and every call it yields has a
string `name` that is one of the offered tools and object `arguments` (a JSON string of
an object is accepted: some templates and models pre-encode them); anything else stays
text (output_parser.py), never a half-valid call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from services.gateway.core.chat_format import ToolParser


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d = {"index": index, **d}
        return d


def validate_call(obj: Any, tool_names: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (tool_names and name not in tool_names):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall("call_" + secrets.token_hex(12), name, json.dumps(args, ensure_ascii=False))


def parse_calls(body: str, parser: ToolParser, tools: list[dict] | None,
                tool_names: set[str] | None) -> list[ToolCall] | None:
    """The calls in one envelope body, or None if it is not (entirely) valid calls."""
    try:
        parsed = parser(body, tools)
    except Exception:  # noqa: BLE001 - parsers raise ValueError, JSON, Syntax, Key errors...
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [validate_call(o, tool_names) for o in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
