"""A model's output format, as mlx-lm reads it from the tokenizer and its chat template:
its reasoning markers (`<think>`/`</think>`, or the template's own) and its tool-call
markers and parser (`mlx_lm.tool_parsers`: json_tools, qwen3_coder, mistral, glm47,
kimi_k2, minimax_m2, pythonic, ...), chosen exactly as `mlx_lm.server` chooses them
(`tokenizer_utils.load`: the tokenizer config's `tool_parser_type`, else inferred from
the chat template, else from the vocabulary).

Built once per model, in the tokenizer-loading thread (importing mlx-lm takes seconds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)


@dataclass(frozen=True)
class ChatFormat:
    think_start: str | None = None
    think_end: str | None = None
    tool_start: str | None = None
    tool_end: str | None = None  # "" (mistral): a call runs to the end of the output
    tool_parser: ToolParser | None = None
    parser_name: str | None = None
    # The chat template's own variables (a template that never reads reasoning_effort
    # cannot honour it: the request is refused rather than silently ignored).
    template_vars: frozenset[str] = field(default_factory=frozenset)
    wrapper: Any = None  # mlx_lm TokenizerWrapper: renders the chat template as mlx-lm does
    # The reasoning markers as token ids (start, end): what reasoning_tokens counts between.
    think_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # The template has no tools (never reads them, no parser known): the gateway writes
    # tools and tool turns into the messages in json_tools's form (tool_prompt.py).
    gateway_tools: bool = False

    @property
    def has_thinking(self) -> bool:
        return bool(self.think_start and self.think_end)

    @property
    def has_tools(self) -> bool:
        return self.tool_parser is not None and bool(self.tool_start)

    def markers(self) -> list[str]:
        """Every marker text the detokenizer must keep even when it is a special token."""
        return [m for m in (self.think_start, self.think_end, self.tool_start, self.tool_end) if m]

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        """The rendered prompt ends inside a reasoning block (a template that opens
        `<think>` in the generation prompt): the output starts as reasoning."""
        if not self.has_thinking:
            return False
        return prompt_text.rfind(self.think_start) > prompt_text.rfind(self.think_end)


def load_format(path: Path) -> tuple[Any, ChatFormat]:
    """mlx-lm's tokenizer wrapper for a model directory and the format read from it."""
    from mlx_lm.tokenizer_utils import load as load_wrapper

    w = load_wrapper(path)
    name = w._tokenizer.init_kwargs.get("tool_parser_type")  # load() records its choice
    template_vars = _template_vars(w._tokenizer)
    tools = (w.tool_call_start, w.tool_call_end, w.tool_parser, name)
    gateway_tools = w.tool_parser is None and bool(template_vars) and "tools" not in template_vars
    if gateway_tools:
        from mlx_lm.tool_parsers import json_tools

        tools = (json_tools.tool_call_start, json_tools.tool_call_end,
                 json_tools.parse_tool_call, "json_tools")
    return w, ChatFormat(
        think_start=w.think_start, think_end=w.think_end,
        tool_start=tools[0], tool_end=tools[1], tool_parser=tools[2], parser_name=tools[3],
        template_vars=template_vars, wrapper=w, gateway_tools=gateway_tools,
        think_ids=(tuple(w.think_start_tokens), tuple(w.think_end_tokens))
        if w.think_start_tokens and w.think_end_tokens else None)


def _template_vars(hf: Any) -> frozenset[str]:
    template = getattr(hf, "chat_template", None)
    if not isinstance(template, str):
        return frozenset()
    try:
        import jinja2
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except Exception:  # noqa: BLE001 - a template jinja cannot parse: no variables known
        return frozenset()
