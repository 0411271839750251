"""Anthropic Messages requests (`POST /v1/messages`, `/v1/messages/count_tokens`): every
field accounted for, validated strictly, and translated into the one internal request
(core/internal_request.py), so generation is never written twice.

`FIELDS` is the single table, as openai/fields.py ROWS is for OpenAI's: validation reads
it, docs/gateway.md's Messages table follows it, and tests/unit/test_anthropic_messages.py
checks it against the fields the installed `anthropic` SDK types (plus the sampling
fields the 2.x SDK no longer types but clients still send). A field in no row is a 400
naming it; a refused one with a value other than null is a 400 naming it.

The translation: anthropic/translate.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.request_params import MESSAGES, params_in
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.field_support import FieldRow, FieldTable, Support
from services.gateway.core.request_body import (
    MAX_MESSAGES,
    MAX_STOPS,
    MAX_TOOLS,
    parse_json,
)
from services.gateway.core.sampling_params import ParamFields

H, OK, NO = Support.HONOURED, Support.HARMLESS, Support.REFUSED
CREATE, COUNT = "messages", "count_tokens"
BILLING_LINE = "x-anthropic-billing-header:"  # Claude Code's per-request attribution line
DEFAULT_EFFORT = "high"  # Anthropic's effort when none is given


def Field_(name: str, create: Support | None, count: Support | None, note: str, *,  # noqa: N802
           untyped: bool = False, extension: bool = False) -> FieldRow:
    """A row in this table's columns (None: not a field of that endpoint). `untyped`: sent
    by clients, not typed by the anthropic 2.x SDK's MessageCreateParams (dropped sampling
    fields; beta fields Claude Code sends); `extension`: ours, as chat spells it."""
    where = tuple((ep, s) for ep, s in ((CREATE, create), (COUNT, count)) if s is not None)
    return FieldRow(name, where, note, untyped=untyped, extension=extension)


FIELDS: tuple[FieldRow, ...] = (
    Field_("model", H, H, "a served model's id (`GET /v1/models`)"),
    Field_("messages", H, H, "user / assistant / system turns; text, tool_use, tool_result, "
           "thinking and redacted_thinking blocks (image, document and server-tool blocks: "
           "400 naming the block); a final assistant turn (prefill): 400"),
    Field_("max_tokens", H, None, "required, >= 1; capped by the context"),
    Field_("system", H, H, "a string or text blocks → a system message (a Claude Code "
           "`x-anthropic-billing-header:` line is dropped: it would defeat the prefix cache)"),
    Field_("stop_sequences", H, None, "up to 16 strings, cut exactly; `stop_reason` "
           "`stop_sequence` names the one matched"),
    Field_("stream", H, None, "Anthropic's SSE event sequence, `ping` while the model is quiet"),
    *(Field_(p.name, H, None, p.note(MESSAGES), untyped=True,
             extension=p.extension_in(MESSAGES)) for p in params_in(MESSAGES)),
    Field_("tools", H, H, "custom (client) tools → function tools; server tools "
           "(`type` other than `custom`) → 400 naming them"),
    Field_("tool_choice", H, H, "`auto`, `any` (constrained: a call is made), `tool` "
           "(constrained: that tool), `none`; `disable_parallel_tool_use` → one call"),
    Field_("thinking", H, H, "`enabled` → the template's `enable_thinking` true, `disabled` "
           "→ false, `adaptive` → the template's default (the model decides; one without a "
           "thinking mode never thinks, so `adaptive` is honoured by every model: Claude "
           "Code sends it); `enabled` for a model without a thinking mode → 400 naming "
           "it; `display: omitted` empties "
           "the thinking text; `budget_tokens` is checked (>= 1024, < max_tokens) but not enforced: "
           "thinking counts toward max_tokens"),
    Field_("output_config", H, H, "`format` json_schema → constrained decoding (as chat's "
           "`response_format`); `effort` → `reasoning_effort` for a template that reads it; "
           "otherwise `high`, Anthropic's default and what the model does anyway, is "
           "accepted (Claude Code sends it) and any other effort is a 400 naming it"),
    Field_("context_management", H, H, "`clear_thinking_20251015` edits: `keep` `all` "
           "keeps every earlier thinking block, `{type: thinking_turns, value: N}` (the "
           "default: 1) keeps those of the last N assistant turns that have any and drops "
           "the rest from the prompt; `clear_tool_uses_20250919` → 400 naming it (a beta "
           "field: Claude Code sends it)", untyped=True),
    Field_("metadata", OK, None, "`user_id`; nothing is stored"),
    Field_("cache_control", OK, OK, "prefix caching is automatic (usage "
           "`cache_read_input_tokens` reports it)"),
    Field_("service_tier", OK, None, "one tier here"),
    Field_("speed", OK, OK, "one speed here"),
    Field_("inference_geo", OK, None, "one location here"),
    Field_("diagnostics", OK, None, "no prompt-cache diagnostics are returned"),
    Field_("user_profile_id", OK, OK, "attribution only; not used"),
    Field_("workspace_id", OK, OK, "one workspace here"),
    Field_("container", NO, None, "no code-execution containers"),
)
TABLE = FieldTable(FIELDS, {CREATE: "/v1/messages", COUNT: "/v1/messages/count_tokens"})
BY_ENDPOINT: dict[str, dict[str, FieldRow]] = {ep: TABLE.of(ep) for ep in (CREATE, COUNT)}


class _M(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class CacheControl(_M):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_M):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # harmless: nothing is cited here


class ToolUseBlock(_M):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_M):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(_M):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(_M):
    type: Literal["redacted_thinking"]
    data: str


BLOCKS: dict[str, type[_M]] = {"text": TextBlock, "tool_use": ToolUseBlock,
                               "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
                               "redacted_thinking": RedactedThinkingBlock}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "system": ("text",),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class Message(_M):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Tool(_M):
    name: str = Field(min_length=1, max_length=256)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the schema is enforced when a call is forced (any / tool)
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None


class ToolChoice(_M):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1, max_length=256)
    disable_parallel_tool_use: bool | None = None


class Thinking(_M):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_M):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_M):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


THINKING_EDIT, TOOL_USES_EDIT = "clear_thinking_20251015", "clear_tool_uses_20250919"


class ThinkingTurns(_M):
    type: Literal["thinking_turns"]
    value: int = Field(ge=1)


class ClearThinking(_M):
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | None = None  # None: Anthropic's default, 1 turn

    def turns_kept(self) -> int | None:
        """How many of the last assistant turns with thinking keep it; None: all."""
        if self.keep == "all":
            return None
        return 1 if self.keep is None else self.keep.value


class ContextManagement(_M):
    edits: list[ClearThinking] = Field(default_factory=list, max_length=8)


class Metadata(_M):
    user_id: str | None = None


class CountTokensRequest(_M):
    model: str = Field(min_length=1, max_length=512)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(ParamFields.MESSAGES, CountTokensRequest):  # type: ignore[misc, name-defined]
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    stream: bool | None = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: None = None  # refused (FIELDS)


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _loc(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    first = exc.errors()[0]
    parts = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    parts = [p for p in parts if p not in ("str", "list[dict[str,any]]")]
    return ".".join(([prefix] if prefix else []) + parts) or prefix, first.get("msg", "invalid")


def validate(raw: bytes, endpoint: str, *, max_messages: int = MAX_MESSAGES,
             max_tools: int = MAX_TOOLS) -> CountTokensRequest:
    """Parse and validate one body (CPU-bound: callers run it off the event loop)."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    for name, most in (("messages", max_messages), ("tools", max_tools)):
        items = obj.get(name)
        if isinstance(items, list) and len(items) > most:
            raise bad(name, f"{len(items)} {name}; at most {most} per request", "too_many_items")
    TABLE.check(obj, endpoint, fail=bad)
    cm = obj.get("context_management")
    for i, e in enumerate((cm.get("edits") or []) if isinstance(cm, dict) else []):
        if isinstance(e, dict) and e.get("type") == TOOL_USES_EDIT:
            raise bad(f"context_management.edits.{i}.type", f"{TOOL_USES_EDIT!r} is not "
                      f"supported here (only {THINKING_EDIT!r})", "unsupported_value")
    for i, t in enumerate(obj.get("tools") or []):
        if isinstance(t, dict) and t.get("type") not in (None, "custom"):
            raise bad(f"tools.{i}.type", f"server tool {t.get('type')!r} is not available here "
                      "(custom tools only)", "unsupported_value")
    if endpoint == CREATE and "max_tokens" not in obj:
        raise bad("max_tokens", "required", "missing_required_parameter")
    cls = MessagesRequest if endpoint == CREATE else CountTokensRequest
    try:
        req = cls.model_validate(obj)
    except ValidationError as exc:
        param, msg = _loc(exc)
        raise bad(param, msg) from None
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, b in enumerate(m.content):
                _block(b, m.role, f"messages.{i}.content.{j}")
    if req.messages[-1].role == "assistant":  # Anthropic's own answer for such models
        raise bad(f"messages.{len(req.messages) - 1}", "a final assistant message (prefill) is "
                  "not supported: the chat template starts a new assistant turn",
                  "unsupported_value")
    tc = req.tool_choice
    if tc is not None and (tc.type == "tool") != (tc.name is not None):
        raise bad("tool_choice.name", "required with type 'tool', and only with it")
    if tc is not None and tc.type in ("any", "tool") and not req.tools:
        raise bad("tool_choice", f"type {tc.type!r} needs tools")
    th = req.thinking
    if th is not None and th.type == "enabled" and th.budget_tokens is None:
        raise bad("thinking.budget_tokens", "required with type 'enabled'")
    if isinstance(req, MessagesRequest) and th is not None and th.budget_tokens is not None \
            and th.budget_tokens >= req.max_tokens:
        raise bad("thinking.budget_tokens", "must be less than max_tokens")
    return req


def _block(b: dict[str, Any], role: str, where: str) -> _M:
    kind = b.get("type")
    if kind not in ROLE_BLOCKS[role]:
        raise bad(f"{where}.type", f"block type {kind!r} is not supported in a {role} message "
                  f"(supported: {', '.join(ROLE_BLOCKS[role])})", "unsupported_value")
    try:
        block = BLOCKS[kind].model_validate(b)
    except ValidationError as exc:
        param, msg = _loc(exc, where)
        raise bad(param, msg) from None
    if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
        for k, part in enumerate(block.content):
            _block(part, "system", f"{where}.content.{k}")  # text blocks only
    return block


def check_model(req: CountTokensRequest, tok: ModelTokenizer) -> None:
    """What only the model can answer: does it think, does its template read effort."""
    th = req.thinking
    fmt = tok.fmt
    if th is not None:
        if th.type == "enabled" and not fmt.has_thinking:
            raise bad("thinking", f"model {tok.path.name} has no thinking mode (its template "
                      "emits no reasoning markers); omit thinking or send type 'disabled' "
                      "or 'adaptive'", "unsupported_value")
        renamed = getattr(fmt.wrapper, "_thinking_kwarg", "enable_thinking") != "enable_thinking"
        if th.type == "disabled" and fmt.has_thinking and not renamed and \
                "enable_thinking" not in fmt.template_vars:
            raise bad("thinking", f"the chat template of {tok.path.name} cannot switch thinking "
                      "off (it reads no enable_thinking)", "unsupported_value")
    oc = req.output_config
    if oc is not None and oc.effort not in (None, DEFAULT_EFFORT) \
            and "reasoning_effort" not in fmt.template_vars:
        raise bad("output_config.effort", f"the chat template of {tok.path.name} does not read "
                  f"an effort (reasoning_effort): only {DEFAULT_EFFORT!r}, Anthropic's default "
                  "and this model's only behaviour, can be honoured", "unsupported_value")


def omit_thinking(req: CountTokensRequest) -> bool:
    return req.thinking is not None and req.thinking.display == "omitted"
