"""Every request field of the two OpenAI endpoints, and what this server does with it.

`ROWS` is the single source for them (rows of field_support.py's one type, checked by its
one loop): validation reads it, docs/gateway.md's field table is checked against it, and
its OpenAI rows are checked against the fields of the real `openai` package's typed
params (tests/unit/test_request_fields.py), so a field OpenAI adds shows up as a failing
test, not as a silent no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from common.request_params import CHAT, COMPLETIONS, params_in
from services.gateway.core.field_support import FieldRow, FieldTable, Support
from services.gateway.core.internal_request import Json

H, OK, NO = Support.HONOURED, Support.HARMLESS, Support.REFUSED
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


def Row(name: str, chat: Support | None, completions: Support | None, note: str, *,  # noqa: N802
        extension: bool = False, neutral: tuple[Json, ...] = (None,)) -> FieldRow:
    """A row in this table's columns (None: not a field of that endpoint)."""
    where = tuple((ep, s) for ep, s in ((CHAT, chat), (COMPLETIONS, completions))
                  if s is not None)
    return FieldRow(name, where, note, neutral=neutral, extension=extension)


ROWS: tuple[FieldRow, ...] = (
    Row("audio", NO, None, "no audio output"),
    Row("best_of", None, NO, "`1` accepted; more candidates than returned is not done here "
        "(use `n`)", neutral=(None, 1)),
    Row("echo", None, H, "the prompt's text before the completion"),
    Row("function_call", NO, None, "deprecated by OpenAI: use `tool_choice`"),
    Row("functions", NO, None, "deprecated by OpenAI: use `tools`"),
    Row("logprobs", H, H, "chat: bool (with `top_logprobs`); completions: int 0-5"),
    Row("max_completion_tokens", H, None, "as `max_tokens`; wins over it"),
    Row("max_tokens", H, H, "default `default_max_tokens`, capped by the context"),
    Row("messages", H, None, "text content parts only; rendered by the model's chat template"),
    Row("metadata", OK, None, "nothing is stored"),
    Row("modalities", H, None, "`[\"text\"]` only; `audio` → 400 naming it"),
    Row("model", H, H, "a served model's id (`GET /v1/models`): a directory name or a "
        "Hugging Face repo id"),
    Row("moderation", NO, None, "no moderation here"),
    Row("n", H, H, "1-16 choices, each its own request (seed+i with a seed)"),
    Row("parallel_tool_calls", H, None, "false: at most one tool call (the first)"),
    Row("prediction", OK, None, "a latency hint (predicted output); output is unaffected"),
    Row("prompt", None, H, "a string, token ids, or a one-element list of either"),
    Row("prompt_cache_key", OK, None, "prefix caching is automatic"),
    Row("prompt_cache_options", OK, None, "prefix caching is automatic"),
    Row("prompt_cache_retention", OK, None, "prefix caching is automatic"),
    Row("reasoning_effort", H, None, "passed to the chat template when it reads "
        "`reasoning_effort`; otherwise 400 `unsupported_value`"),
    Row("response_format", H, None, "`text`, `json_object`, `json_schema`: constrained decoding"),
    Row("safety_identifier", OK, None, "an end-user id for OpenAI's abuse checks; like `user`"),
    Row("service_tier", OK, None, "one tier here"),
    Row("stop", H, H, "up to 16 strings, cut exactly"),
    Row("store", OK, None, "nothing is stored"),
    Row("stream", H, H, "SSE, ends `data: [DONE]`"),
    Row("stream_options", H, H, "`include_usage`; `include_obfuscation` is harmless"),
    Row("suffix", None, NO, "no fill-in-the-middle", neutral=(None, "")),
    Row("tool_choice", H, None, "`none`, `auto`, `required`, a named function"),
    Row("tools", H, None, "rendered by the chat template; calls parsed by the model's "
        "mlx-lm tool parser (a template without tools: written into the system message in "
        "json_tools's form by the gateway, services/gateway/core/tool_prompt.py)"),
    Row("top_logprobs", H, None, "0-20, with `logprobs: true`"),
    Row("user", OK, OK, "an end-user id; not used"),
    Row("verbosity", NO, None, "a steering hint for OpenAI's models: no such control here"),
    Row("web_search_options", NO, None, "no web search"),
    # Extensions (extra_body with the openai client), spelled as vLLM / mlx_lm.server do.
    Row("chat_template_kwargs", H, None, "an object of extra variables for the chat template, "
        "e.g. `{\"enable_thinking\": false}`", extension=True),
)

# The declared parameters (common/request_params.py): the same in both endpoints.
ROWS = tuple(sorted((*ROWS, *(Row(p.name, H, H, p.note(CHAT), extension=p.extension_in(CHAT))
                              for p in params_in(CHAT))),
                    key=lambda r: (r.extension, r.name)))

TABLE = FieldTable(ROWS, PATHS)
BY_ENDPOINT: dict[str, dict[str, FieldRow]] = {ep: TABLE.of(ep) for ep in PATHS}
if len({r.name for r in ROWS}) != len(ROWS):  # one row per field
    raise ImportError("openai/fields.py ROWS names a field twice")


def check(obj: Mapping[str, Json], endpoint: str, schema_fields: Iterable[str]) -> None:
    """Refuse, naming it, the first field of `obj` that is unknown, refused, or honoured
    by the table but absent from the schema (`schema_fields`: the pydantic model's)."""
    TABLE.check(obj, endpoint, schema_fields=schema_fields)
