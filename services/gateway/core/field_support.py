"""What this server does with each request field, for every API: one row type, one refusal
loop. Each API declares its rows where it lives (openai/fields.py for chat and
completions, responses/schemas.py, anthropic/schemas.py); validation, docs/gateway.md's
field tables and the tests against each SDK's typed params all read them.

- honoured: it has its effect (tested per field);
- harmless: accepted and without effect, where none is owed to the client;
- refused: any value but null (or the row's neutral values) is a 400
  `unsupported_parameter` naming it.

A field in no row of its endpoint is a 400 `unknown_parameter` naming it (and, when it
belongs to a sibling endpoint of the same API, which). vLLM accepts unknown fields and
only logs a warning; a misspelt `max_token` would then be silently ignored, which is the
failure these rows exist to prevent. A row marked honoured whose field the schema does
not (yet) have is refused too: never silently dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import Json


class Support(enum.StrEnum):
    HONOURED = "honoured"
    HARMLESS = "harmless"
    REFUSED = "refused"


@dataclass(frozen=True)
class FieldRow:
    name: str
    where: tuple[tuple[str, Support], ...]  # (endpoint, support) where it is a field
    note: str
    neutral: tuple[Json, ...] = (None,)  # values a refused field may take (= absent)
    extension: bool = False  # not the API's own: ours (common/request_params.py's spelling)
    untyped: bool = False  # sent by clients, not typed by the API's SDK

    def support(self, endpoint: str) -> Support | None:
        """None: not a field of `endpoint`."""
        return dict(self.where).get(endpoint)

    def is_neutral(self, value: Json) -> bool:
        return any(value is n or (type(value) is type(n) and value == n) for n in self.neutral)


Fail = Callable[[str, str, str], ApiError]  # (param, message, code) → the API's 400


def openai_fail(param: str, message: str, code: str) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class FieldTable:
    """One API's rows, by endpoint (its paths name where a misplaced field belongs)."""

    rows: tuple[FieldRow, ...]
    paths: Mapping[str, str]  # endpoint → its path, e.g. "chat" → "/v1/chat/completions"

    def __post_init__(self) -> None:
        seen = [(ep, r.name) for r in self.rows for ep, _ in r.where]
        if len(set(seen)) != len(seen):
            raise ValueError("a field is declared twice for one endpoint")

    def of(self, endpoint: str) -> dict[str, FieldRow]:
        return {r.name: r for r in self.rows if r.support(endpoint) is not None}

    def check(self, obj: Mapping[str, Json], endpoint: str, *, fail: Fail = openai_fail,
              schema_fields: Iterable[str] | None = None) -> None:
        """Refuse, naming it, the first field of `obj` that is unknown, refused, or
        honoured here but absent from the schema (`schema_fields`, when given)."""
        rows = self.of(endpoint)
        typed = None if schema_fields is None else set(schema_fields)
        for name, value in obj.items():
            row = rows.get(name)
            if row is None:
                elsewhere = [ep for ep in self.paths if ep != endpoint and name in self.of(ep)]
                where = f"; it is a field of {self.paths[elsewhere[0]]}" if elsewhere else ""
                raise fail(name, f"unknown parameter {name!r}{where}", "unknown_parameter")
            support = row.support(endpoint)
            missing = support is Support.HONOURED and typed is not None and name not in typed
            if (support is Support.REFUSED or missing) and not row.is_neutral(value):
                note = f": {row.note}" if support is Support.REFUSED else ""
                raise fail(name, f"{name!r} is not supported by this server{note}",
                           "unsupported_parameter")
