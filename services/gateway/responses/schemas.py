"""OpenAI Responses requests (`POST /v1/responses`): every field accounted for, validated
strictly; responses/translate.py turns one into the one internal request
(core/internal_request.py), so generation is never written twice.

`FIELDS` is the single table, as openai/fields.py ROWS is for chat: validation reads it,
docs/gateway.md's Responses table follows it, and tests/unit/test_responses.py checks it
against the fields the installed `openai` SDK types (`ResponseCreateParams`; a row
marked `untyped` is a field clients send that the SDK does not type). A field in
no row is a 400 `unknown_parameter` naming it; a refused one with a value other than its
neutral ones a 400 `unsupported_parameter` naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.request_params import RESPONSES, params_in
from services.gateway.core.errors import ApiError
from services.gateway.core.field_support import FieldRow, FieldTable, Support
from services.gateway.core.internal_request import Json
from services.gateway.core.request_body import MAX_MESSAGES, MAX_TOOLS, parse_json
from services.gateway.core.sampling_params import MAX_TOP_LOGPROBS, ParamFields
from services.gateway.responses.tools import FunctionTool, NamespaceTool, forced_name
from services.gateway.responses.tools import check as check_tools

H, OK, NO = Support.HONOURED, Support.HARMLESS, Support.REFUSED
LOGPROBS_INCLUDE = "message.output_text.logprobs"
HARMLESS_INCLUDE = "reasoning.encrypted_content"  # Codex asks for it with store: false


ENDPOINT = "responses"


def Field_(name: str, support: Support, note: str, *, neutral: tuple[Json, ...] = (None,),  # noqa: N802
           untyped: bool = False, extension: bool = False) -> FieldRow:
    """A row: `neutral`, values a refused field may take (= absent); `untyped`, sent by
    clients, not typed by the openai SDK's ResponseCreateParams; `extension`, ours."""
    return FieldRow(name, ((ENDPOINT, support),), note, neutral=neutral, untyped=untyped,
                    extension=extension)


FIELDS: tuple[FieldRow, ...] = (
    Field_("model", H, "a served model's id (`GET /v1/models`)"),
    Field_("input", H, "a string, or items: `message` (input_text / output_text / refusal "
           "parts), `function_call` (with a `namespace`: "
           "that namespace's function), `function_call_output`, `reasoning`; `developer` and "
           "`system` messages → system messages; any other item or part type → 400 naming it"),
    Field_("instructions", H, "a system message before the input (not carried over by "
           "`previous_response_id`, as OpenAI's)"),
    Field_("previous_response_id", H, "a stored response: its conversation (input and output "
           "items) comes first; unknown or expired → 404"),
    Field_("store", H, "default true: kept in the gateway's bounded store (see retention); "
           "false keeps nothing"),
    Field_("stream", H, "typed SSE events with sequence numbers"),
    Field_("stream_options", OK, "`include_obfuscation`: no obfuscation padding is sent"),
    Field_("tools", H, "function tools, and `namespace` tools (their functions offered as "
           "`namespace__name`, the namespace's description first; calls come back with `name` "
           "and `namespace`); hosted tools (`web_search`, ...) and any other type → 400 "
           "naming it"),
    Field_("tool_choice", H, "`none`, `auto`, `required`, `{type: function, name}` (a plain "
           "function, else the one namespaced function of that name; the last two "
           "constrained: a call is made); other forms → 400"),
    Field_("parallel_tool_calls", H, "false: at most one function call"),
    Field_("max_tool_calls", H, "function calls past this many are dropped (1 also "
           "constrains a required call to one)"),
    Field_("text", H, "`format`: `text`, `json_object`, `json_schema` (constrained decoding, "
           "as chat's `response_format`); `verbosity` other than null → 400"),
    Field_("max_output_tokens", H, "as chat's `max_completion_tokens`; capped by the context"),
    *(Field_(p.name, H, p.note(RESPONSES), extension=p.extension_in(RESPONSES))
      for p in params_in(RESPONSES)),
    Field_("top_logprobs", H, "0-20; logprobs are returned with `include: "
           "[\"message.output_text.logprobs\"]`"),
    Field_("include", H, "`message.output_text.logprobs` honoured; "
           "`reasoning.encrypted_content` harmless (reasoning items carry their text); "
           "others → 400"),
    Field_("reasoning", H, "`effort` → the template's `reasoning_effort`, else (a model with "
           "a thinking mode) `enable_thinking` (false for `none`); a model without one → 400 "
           "unless `none`; `summary`, `generate_summary`, `context`: harmless (reasoning "
           "items carry the full text)"),
    Field_("truncation", H, "`disabled` (the default): a prompt over the context is a 400; "
           "`auto` → 400", neutral=(None, "disabled")),
    Field_("metadata", H, "kept and returned with the response"),
    Field_("user", OK, "an end-user id; not used"),
    Field_("safety_identifier", OK, "an end-user id for abuse checks; not used"),
    Field_("service_tier", OK, "one tier here"),
    Field_("prompt_cache_key", OK, "prefix caching is automatic"),
    Field_("prompt_cache_options", OK, "prefix caching is automatic"),
    Field_("prompt_cache_retention", OK, "prefix caching is automatic"),
    Field_("access_programs", OK, "one access program here"),
    Field_("image", OK, "image options; no image input is accepted (input_image → 400)"),
    Field_("background", H, "runs past its request: GET shows it, `POST "
           "/v1/responses/{id}/cancel` aborts it on every rank; needs `store`, not `stream`"),
    Field_("background_options", NO, "no completion windows: background responses start "
           "at once"),
    Field_("conversation", NO, "no Conversations API: chain with `previous_response_id`"),
    Field_("context_management", NO, "no server-side compaction"),
    Field_("prompt", NO, "no stored prompt templates"),
    Field_("moderation", NO, "no moderation here"),
    Field_("client_metadata", OK, "an object of strings about the client's turn (Codex sends "
           "its session and turn ids); not stored or returned", untyped=True),
)
TABLE = FieldTable(FIELDS, {ENDPOINT: "/v1/responses"})
BY_NAME: dict[str, FieldRow] = TABLE.of(ENDPOINT)


class _M(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class Part(_M):
    type: Literal["input_text", "output_text", "refusal", "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_M):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_M):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class FunctionCallOutputItem(_M):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class ReasoningItem(_M):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


ITEMS: dict[str, type[_M]] = {"message": MessageItem, "function_call": FunctionCallItem,
                              "function_call_output": FunctionCallOutputItem,
                              "reasoning": ReasoningItem}
ROLE_PARTS = {"assistant": ("output_text", "refusal", "input_text")}
ANY_TEXT = ("input_text", "output_text")


class TextFormat(_M):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_M):
    format: TextFormat | None = None
    verbosity: None = None  # refused: no such control here


class Reasoning(_M):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Literal["standard"] | None = None


class StreamOptions(_M):
    include_obfuscation: bool | None = None  # harmless: no obfuscation padding is sent


class ResponsesRequest(ParamFields.RESPONSES, _M):  # type: ignore[misc, name-defined]
    model: str = Field(min_length=1, max_length=512)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    store: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool | NamespaceTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    access_programs: dict[str, Any] | None = None
    background: bool | None = None
    image: dict[str, Any] | None = None
    client_metadata: dict[str, str] | None = None
    # Refused (FIELDS): only their neutral values get this far.
    background_options: None = None
    conversation: None = None
    context_management: None = None
    prompt: None = None
    moderation: None = None

    def stored(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def bad(param: str, message: str, code: str = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, f"{param}: {message}", param=param, code=code)


def _loc(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    first = exc.errors()[0]
    parts = [str(p) for p in first.get("loc", ())
             if not str(p).startswith(("function-", "union[", "literal[")) and str(p) not in
             ("str", "list[dict[str,any]]", "dict[str,any]")]
    return ".".join(([prefix] if prefix else []) + parts) or prefix, first.get("msg", "invalid")


def validate(raw: bytes, *, max_messages: int = MAX_MESSAGES,
             max_tools: int = MAX_TOOLS) -> ResponsesRequest:
    """Parse and validate one body (CPU-bound: callers run it off the event loop)."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    for name, most in (("input", max_messages), ("tools", max_tools)):
        items = obj.get(name)
        if isinstance(items, list) and len(items) > most:
            raise bad(name, f"{len(items)} {name} items; at most {most} per request",
                      "too_many_items")
    TABLE.check(obj, ENDPOINT, fail=bad)
    check_tools(obj.get("tools"), max_tools)
    if obj.get("truncation") == "auto":
        raise bad("truncation", "'auto' (dropping input to fit the context) is not supported; "
                  "a prompt over the context is a 400", "unsupported_value")
    if isinstance(obj.get("text"), dict) and obj["text"].get("verbosity") is not None:
        raise bad("text.verbosity", "a steering hint for OpenAI's models: no such control here",
                  "unsupported_parameter")
    try:
        req = ResponsesRequest.model_validate(obj)
    except ValidationError as exc:
        param, msg = _loc(exc)
        raise bad(param, msg) from None
    if isinstance(req.input, list):
        if not req.input:
            raise bad("input", "at least one item")
        for i, item in enumerate(req.input):
            _item(item, f"input.{i}")
    for k, inc in enumerate(req.include or []):
        if inc not in (LOGPROBS_INCLUDE, HARMLESS_INCLUDE):
            raise bad(f"include.{k}", f"{inc!r} is not available here (supported: "
                      f"{LOGPROBS_INCLUDE!r}, {HARMLESS_INCLUDE!r})", "unsupported_value")
    _check_tool_choice(req)
    if req.background and not req.stored():
        raise bad("store", "a background response is kept in the store: store false is not "
                  "possible with background true")
    if req.background and req.stream:
        raise bad("stream", "a background response is not streamed here: poll GET "
                  "/v1/responses/{id}", "unsupported_value")
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema" and (fmt.schema_ is None or fmt.name is None):
        raise bad("text.format", "type 'json_schema' needs 'name' and 'schema'")
    return req


def _check_tool_choice(req: ResponsesRequest) -> None:
    tc = req.tool_choice
    if tc is None or tc in ("none", "auto", "required"):
        if tc == "required" and not req.tools:
            raise bad("tool_choice", "'required' needs tools")
        return
    if isinstance(tc, str):
        raise bad("tool_choice", f"{tc!r}: expected 'none', 'auto', 'required' or "
                  "{'type': 'function', 'name': ...}")
    if tc.get("type") != "function":
        raise bad("tool_choice.type", f"{tc.get('type')!r} is not available here (function "
                  "tools only)", "unsupported_value")
    if set(tc) - {"type", "name"} or not isinstance(tc.get("name"), str):
        raise bad("tool_choice", "expected {'type': 'function', 'name': ...}")
    forced_name(req.tools, tc["name"])  # a 400 unless it names exactly one function


def _item(item: dict[str, Any], where: str) -> _M:
    kind = item.get("type", "message" if "role" in item else None)
    cls = ITEMS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise bad(f"{where}.type", f"input item type {kind!r} is not supported here "
                  f"(supported: {', '.join(ITEMS)})", "unsupported_value")
    try:
        it = cls.model_validate(item)
    except ValidationError as exc:
        param, msg = _loc(exc, where)
        raise bad(param, msg) from None
    parts = (it.content if isinstance(it, MessageItem) else
             it.output if isinstance(it, FunctionCallOutputItem) else [])
    if isinstance(it, ReasoningItem):
        parts = [*it.summary, *(it.content or [])]
    allowed = ROLE_PARTS.get(getattr(it, "role", ""), ANY_TEXT)
    if isinstance(it, ReasoningItem):
        allowed = ("summary_text", "reasoning_text")
    for k, p in enumerate(parts if isinstance(parts, list) else []):
        if p.get("type") not in allowed:
            raise bad(f"{where}.content.{k}.type", f"content part type {p.get('type')!r} is not "
                      f"supported here (supported: {', '.join(allowed)})", "unsupported_value")
        try:
            Part.model_validate(p)
        except ValidationError as exc:
            param, msg = _loc(exc, f"{where}.content.{k}")
            raise bad(param, msg) from None
    return it

