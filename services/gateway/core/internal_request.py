"""The one internal request: what chat, completions, Responses and Messages each translate
into, and all the shared path (request_path.admit → rank 0) reads. Typed end to end:
JSON the client sent (messages, tool schemas) is `Json`, never `Any`.

    GenerationRequest(model, input=ChatInput(...) | TextInput(...), n, max_tokens, stops,
                      params (seed among them), logprobs, tool_choice, parallel_tool_calls,
                      response_format)

Each API's translator builds one from its validated request (openai/translate.py,
anthropic/translate.py, responses/translate.py); the builders here (`turn`, `function_tool`)
give every API the same message and tool dicts, key order included, since the chat
template renders them (tools as JSON) and the prompt must not depend on the API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from common.request_params import ParamValue

Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]
JsonObject = dict[str, Json]

NO_LOGPROBS = -1


@dataclass(frozen=True)
class ChatInput:
    """Messages for the model's chat template, with what else the template reads."""

    messages: list[JsonObject]  # as the template takes them (`turn`)
    tools: list[JsonObject] | None = None  # function tools offered (`function_tool`); None: none
    template_kwargs: JsonObject = field(default_factory=dict)  # chat_template_kwargs, checked later
    reasoning_effort: str | None = None  # for a template that reads it (else a 400 later)


@dataclass(frozen=True)
class TextInput:
    """A raw prompt (completions): text, or token ids."""

    text: str | None = None
    ids: list[int] | None = None  # exactly one of text / ids
    echo: bool = False  # the prompt's text goes before the completion


@dataclass(frozen=True)
class GenerationRequest:
    model: str
    input: ChatInput | TextInput
    n: int = 1
    max_tokens: int | None = None  # None: the gateway's default (capped by the context)
    stops: tuple[str, ...] = ()
    params: Mapping[str, ParamValue] = field(default_factory=dict)  # declared, as given
    logprobs: int = NO_LOGPROBS  # alternatives per token (0: the chosen only); -1: none
    tool_choice: str | JsonObject | None = None  # "none" | "auto" | "required" | named
    parallel_tool_calls: bool | None = None  # False: at most one call
    response_format: JsonObject | None = None  # chat's form: checked by structured.py

    @property
    def seed(self) -> int | None:
        """The client's seed; None: admission draws one."""
        seed = self.params.get("seed")
        return seed if isinstance(seed, int) else None

    @property
    def chat(self) -> bool:
        return isinstance(self.input, ChatInput)

    def tools(self) -> list[JsonObject] | None:
        """The tools the model is offered (none when tool_choice is "none")."""
        if not isinstance(self.input, ChatInput) or self.tool_choice == "none":
            return None
        return self.input.tools or None

    def tool_names(self) -> set[str] | None:
        tools = self.tools()
        return None if tools is None else {tool_name(t) for t in tools}

    def with_input(self, **changes: object) -> GenerationRequest:
        """A copy whose chat input has `changes` (what only the model can decide)."""
        assert isinstance(self.input, ChatInput)
        return replace(self, input=replace(self.input, **changes))  # type: ignore[arg-type]


def turn(role: str, content: str | None, *, name: str | None = None,
         tool_calls: list[JsonObject] | None = None, tool_call_id: str | None = None,
         reasoning_content: str | None = None) -> JsonObject:
    """One message as chat templates take it (developer → system; empty extras left out)."""
    d: JsonObject = {"role": "system" if role == "developer" else role, "content": content}
    if name:
        d["name"] = name
    if tool_calls:
        d["tool_calls"] = list(tool_calls)
    if tool_call_id:
        d["tool_call_id"] = tool_call_id
    if reasoning_content:
        d["reasoning_content"] = reasoning_content
    return d


def function_tool(name: str, parameters: JsonObject | None = None,
                  description: str | None = None, strict: bool | None = None) -> JsonObject:
    """One function tool as chat templates take it (OpenAI's form, one key order)."""
    fn: JsonObject = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def tool_name(tool: JsonObject) -> str:
    fn = tool["function"]
    assert isinstance(fn, dict) and isinstance(fn["name"], str)
    return fn["name"]


def tool_parameters(tool: JsonObject) -> JsonObject | None:
    fn = tool["function"]
    assert isinstance(fn, dict)
    params = fn.get("parameters")
    return params if isinstance(params, dict) else None


def stop_list(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """`stop` in any API's form, empty strings dropped."""
    s = [stop] if isinstance(stop, str) else list(stop or [])
    return tuple(x for x in s if x)
