"""From generated text to what a chat client sees: content, reasoning, tool calls.

`OutputParser` is fed text as it is detokenized and returns, in generation order,
("content", str), ("reasoning", str) and ("tool_call", ToolCall) events. It is the state
machine of mlx-lm's server (generate.make_text_state_machine) with the model's own
markers (chat_format.py): content → reasoning at the think start, back at its end;
content or reasoning → tool at the tool-call start, back to content at its end. Text
that may be the start of a marker is held until the next text decides it.

A tool-call envelope is emitted only once it is complete and its calls validate
(toolcalls.py), so `tool_calls` deltas stream in order and are never retracted; an
envelope that does not parse, names an unknown tool, runs past MAX_ENVELOPE or is still
open at the end is content, as the model wrote it. Whitespace right before an
envelope, after the last one, and at the start of the answer after reasoning is
formatting: dropped — decided on the text, never on how it was split into chunks.
"""

from __future__ import annotations

import enum

from services.gateway.core.chat_format import ChatFormat
from services.gateway.core.toolcalls import ToolCall, parse_calls

MAX_ENVELOPE = 256 * 1024  # an envelope body longer than this is given up as text


class State(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL = "tool"


Event = tuple[str, object]


def _partial(buf: str, markers: list[str]) -> int:
    """Length of the longest end of `buf` that a marker starts with (held back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


class OutputParser:
    def __init__(self, fmt: ChatFormat, *, tools: list[dict] | None = None,
                 tool_names: set[str] | None = None, in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self.tools = tools
        self.tool_names = tool_names
        self.tools_on = tool_names is not None and fmt.has_tools
        self.state = State.REASONING if in_reasoning and fmt.has_thinking else State.CONTENT
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._body = ""  # the open envelope's body
        self._ws = ""  # whitespace-only content held until we know what follows it
        self._after_reasoning = False  # content has not started since reasoning ended

    def _edges(self) -> list[tuple[str, State]]:
        f, out = self.fmt, []
        if self.state is State.TOOL:
            return [(f.tool_end, State.CONTENT)] if f.tool_end else []
        if self.state is State.CONTENT and f.has_thinking:
            out.append((f.think_start, State.REASONING))
        if self.state is State.REASONING:
            out.append((f.think_end, State.CONTENT))
        if self.tools_on:
            out.append((f.tool_start, State.TOOL))
        return out

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf:
            edges = self._edges()
            hits = [(self._buf.find(m), m, to) for m, to in edges if m in self._buf]
            if not hits:
                keep = _partial(self._buf, [m for m, _ in edges])
                self._emit(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                if self.state is State.TOOL and len(self._body) > MAX_ENVELOPE:
                    self._give_up(out)  # runaway: the envelope is text
                    continue
                break
            i, marker, to = min(hits, key=lambda h: h[0])
            self._emit(self._buf[:i], out, before_call=to is State.TOOL)
            self._buf = self._buf[i + len(marker):]
            self._move(to, out)
        return out

    def flush(self) -> list[Event]:
        """End of generation: an open envelope (mistral's runs to the end) is parsed or
        kept as text; held text is emitted."""
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        self._emit(rest, out)
        if self.state is State.TOOL:
            if self.fmt.tool_end == "" and self._close_envelope(out):
                pass
            else:
                self._give_up(out)
        if self._ws and not self.calls:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    def _move(self, to: State, out: list[Event]) -> None:
        if self.state is State.TOOL:  # the envelope's end marker
            self.state = State.CONTENT
            if not self._close_envelope(out):
                self._content(self.fmt.tool_start + self._body + (self.fmt.tool_end or ""), out)
            self._body = ""
            return
        if self.state is State.REASONING and to is State.CONTENT:
            self._after_reasoning = True
        self.state = to

    def _close_envelope(self, out: list[Event]) -> bool:
        calls = parse_calls(self._body, self.fmt.tool_parser, self.tools, self.tool_names)  # type: ignore[arg-type]
        if calls is None:
            return False
        self._ws = ""
        self._after_reasoning = False
        for c in calls:
            self.calls.append(c)
            out.append(("tool_call", c))
        self._body = ""
        self.state = State.CONTENT
        return True

    def _give_up(self, out: list[Event]) -> None:
        text = self.fmt.tool_start + self._body + self._buf
        self.state, self._body, self._buf = State.CONTENT, "", ""
        self._content(text, out)

    def _emit(self, text: str, out: list[Event], *, before_call: bool = False) -> None:
        if not text:
            return
        if self.state is State.TOOL:
            self._body += text
        elif self.state is State.REASONING:
            out.append(("reasoning", text))
        else:
            self._content(text, out, before_call=before_call)

    def _content(self, text: str, out: list[Event], *, before_call: bool = False) -> None:
        if self._after_reasoning:
            text = text.lstrip()
            if not text:
                return
            self._after_reasoning = False
        # Trailing whitespace is held until text follows it (then it is content) or an
        # envelope does (then it is formatting, dropped): the same whichever way the
        # text was split into chunks.
        body = text.rstrip()
        if body:
            out.append(("content", self._ws + body))
            self._ws = ""
        self._ws = "" if before_call else self._ws + text[len(body):]
