"""Every request field of the two OpenAI endpoints, and what this server does with it.

One table (`ROWS`), the single source: validation reads it, docs/gateway.md's field table
is checked against it, and its OpenAI rows are checked against the fields of the real
`openai` package's typed params (tests/unit/test_request_fields.py), so a field OpenAI
adds shows up as a failing test, not as a silent no-op.

- honoured: it has its effect (tested per field);
- harmless: accepted and without effect, where none is owed to the client (`user`,
  `metadata`, a cache hint, ...);
- refused: any value but null (or the row's neutral values) is a 400
  `unsupported_parameter` naming it.

A field in no row — neither OpenAI's nor one of our documented extensions — is a 400
`unknown_parameter` naming it. (vLLM accepts unknown fields and only logs a warning; a
misspelt `max_token` or a `guided_json` this server does not know would then be silently
ignored, which is the failure this table exists to prevent.) A row marked honoured whose
field the schema does not (yet) have is refused too: never silently dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.request_params import CHAT, COMPLETIONS, params_in
from services.gateway.errors import ApiError


class Support(enum.StrEnum):
    HONOURED = "honoured"
    HARMLESS = "harmless"
    REFUSED = "refused"


H, OK, NO = Support.HONOURED, Support.HARMLESS, Support.REFUSED


@dataclass(frozen=True)
class Row:
    name: str
    chat: Support | None  # None: not a field of that endpoint
    completions: Support | None
    note: str
    extension: bool = False  # not OpenAI's: ours (vLLM's / mlx_lm.server's spelling)
    neutral: tuple[Any, ...] = (None,)  # values a refused field may take (= absent)

    def support(self, endpoint: str) -> Support | None:
        return self.chat if endpoint == CHAT else self.completions


ROWS: tuple[Row, ...] = (
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
        "json_tools's form by the gateway, services/gateway/tool_prompt.py)"),
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

BY_ENDPOINT: dict[str, dict[str, Row]] = {
    ep: {r.name: r for r in ROWS if r.support(ep) is not None} for ep in (CHAT, COMPLETIONS)}
if len({r.name for r in ROWS}) != len(ROWS):  # one row per field
    raise ImportError("request_fields.ROWS names a field twice")


def check(obj: Mapping[str, Any], endpoint: str, schema_fields: Mapping[str, Any]) -> None:
    """Refuse, naming it, the first field of `obj` that is unknown, refused, or honoured
    by the table but absent from the schema (`schema_fields`: the pydantic model's)."""
    rows = BY_ENDPOINT[endpoint]
    for name, value in obj.items():
        row = rows.get(name)
        if row is None:
            other = COMPLETIONS if endpoint == CHAT else CHAT
            where = (f"; it is a field of /v1/{'chat/' if other == CHAT else ''}completions"
                     if name in BY_ENDPOINT[other] else "")
            raise ApiError(400, f"unknown parameter {name!r}{where}", param=name,
                           code="unknown_parameter")
        support = row.support(endpoint)
        missing = support is Support.HONOURED and name not in schema_fields
        if (support is Support.REFUSED or missing) and not _neutral(value, row):
            raise ApiError(400, f"{name!r} is not supported by this server"
                           + (f": {row.note}" if support is Support.REFUSED else ""),
                           param=name, code="unsupported_parameter")


def _neutral(value: Any, row: Row) -> bool:
    return any(value is n or (type(value) is type(n) and value == n) for n in row.neutral)
