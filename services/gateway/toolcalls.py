"""Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`ToolCallParser` is fed generated text as it arrives and returns, in order, content
pieces and validated tool calls. An envelope becomes a tool call only when it is
complete, its body is a JSON object with a string `name` (one of the offered tools) and
object `arguments`; anything else — bad JSON, unknown tool, unclosed at the end — stays
text. Whitespace-only text next to envelopes is formatting and is dropped.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MAX_ENVELOPE = 256 * 1024  # an envelope body longer than this is given up as text


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


def parse_envelope(body: str, tool_names: set[str] | None) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (tool_names and name not in tool_names):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates/models emit the arguments pre-encoded
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall("call_" + secrets.token_hex(12), name, json.dumps(args, ensure_ascii=False))


def _partial(buf: str, token: str) -> int:
    for n in range(min(len(token) - 1, len(buf)), 0, -1):
        if buf.endswith(token[:n]):
            return n
    return 0


class ToolCallParser:
    def __init__(self, tool_names: set[str] | None = None) -> None:
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False
        self._ws = ""  # whitespace-only text held until we know what follows it

    def feed(self, text: str) -> list[tuple[str, object]]:
        """Events: ("content", str) and ("tool_call", ToolCall), in generation order."""
        out: list[tuple[str, object]] = []
        self._buf += text
        while self._buf:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i == -1:
                    keep = _partial(self._buf, OPEN)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._content(self._buf[:i], out, before_call=True)
                self._buf, self._inside = self._buf[i + len(OPEN):], True
            else:
                j = self._buf.find(CLOSE)
                if j == -1:
                    if len(self._buf) > MAX_ENVELOPE:  # runaway: give it up as text
                        self._inside, self._buf = False, OPEN + self._buf
                        self._content(self._buf, out)
                        self._buf = ""
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE):]
                self._inside = False
                call = parse_envelope(body, self.tool_names)
                if call is None:
                    self._content(OPEN + body + CLOSE, out)
                else:
                    self._ws = ""
                    self.calls.append(call)
                    out.append(("tool_call", call))
        return out

    def flush(self) -> list[tuple[str, object]]:
        """End of generation: an unclosed envelope or held text is content."""
        out: list[tuple[str, object]] = []
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        if rest:
            self._content(rest, out)
        if self._ws and not self.calls:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    def _content(self, text: str, out: list, *, before_call: bool = False) -> None:
        if not text:
            return
        if not text.strip():
            self._ws = "" if before_call else self._ws + text
            return
        out.append(("content", self._ws + text))
        self._ws = ""
