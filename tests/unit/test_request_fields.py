"""The request-field table (services/gateway/openai/fields.py) is complete by
construction: its OpenAI rows are exactly the fields of the real `openai` package's typed
params, docs/gateway.md's table is exactly it, and every honoured row is a field the
schema reads (a row ahead of the code is refused at run time, and fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typing_extensions
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from services.gateway.core.errors import ApiError
from services.gateway.openai import fields as rf
from services.gateway.openai.schemas import ChatRequest, CompletionRequest, validate

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {rf.CHAT: ChatRequest, rf.COMPLETIONS: CompletionRequest}
MSGS = [{"role": "user", "content": "hi"}]
BASE = {rf.CHAT: {"model": "m", "messages": MSGS}, rf.COMPLETIONS: {"model": "m", "prompt": "hi"}}


def openai_fields(module) -> set[str]:
    """Every request field of an endpoint: the union over its typed params (streaming
    and not: `stream` lives in those)."""
    out: set[str] = set()
    for name in dir(module):
        cls = getattr(module, name)
        if name.startswith("CompletionCreateParams") and typing_extensions.is_typeddict(cls):
            out |= set(cls.__annotations__)
    return out


@pytest.mark.parametrize(("endpoint", "module"), [(rf.CHAT, chat_params),
                                                  (rf.COMPLETIONS, completion_params)])
def test_openai_rows_are_the_openai_package_fields(endpoint, module):
    ours = {n for n, r in rf.BY_ENDPOINT[endpoint].items() if not r.extension}
    theirs = openai_fields(module)
    assert "stream" in theirs and "model" in theirs
    assert ours == theirs, (f"{endpoint}: fields of the openai package without a row: "
                            f"{sorted(theirs - ours)}; rows OpenAI does not have (mark them "
                            f"extension=True): {sorted(ours - theirs)}")


def docs_rows() -> dict[str, tuple[str, str, bool]]:
    lines = (REPO / "docs" / "gateway.md").read_text().splitlines()
    i = lines.index("| field | chat | completions | notes |")
    out = {}
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        name, chat, comp, _ = (c.strip() for c in line.strip("|").split("|", 3))
        ext = name.endswith("(ext.)")
        out[name.removesuffix("(ext.)").strip().strip("`")] = (chat, comp, ext)
    return out


def test_docs_table_is_the_code_table():
    def cell(s):
        return s.value if s else "—"
    code = {r.name: (cell(r.support(rf.CHAT)), cell(r.support(rf.COMPLETIONS)), r.extension)
            for r in rf.ROWS}
    assert docs_rows() == code


@pytest.mark.parametrize("endpoint", [rf.CHAT, rf.COMPLETIONS])
def test_every_honoured_row_is_read_by_the_schema(endpoint):
    fields = SCHEMA[endpoint].model_fields
    missing = sorted(n for n, r in rf.BY_ENDPOINT[endpoint].items()
                     if r.support(endpoint) is rf.Support.HONOURED and n not in fields)
    assert not missing, f"{endpoint}: honoured by the table, absent from the schema (refused " \
                        f"at run time until they land): {missing}"


def _err(endpoint: str, **extra) -> ApiError | None:
    try:
        validate(SCHEMA[endpoint], json.dumps({**BASE[endpoint], **extra}).encode())
    except ApiError as exc:
        return exc
    return None


@pytest.mark.parametrize("endpoint", [rf.CHAT, rf.COMPLETIONS])
def test_unknown_and_refused_fields_are_named(endpoint):
    e = _err(endpoint, max_token=5)  # a typo is not silently ignored
    assert (e.status, e.code, e.param) == (400, "unknown_parameter", "max_token")
    for row in rf.BY_ENDPOINT[endpoint].values():
        if row.support(endpoint) is rf.Support.REFUSED:
            e = _err(endpoint, **{row.name: "x"})
            assert (e.status, e.code, e.param) == (400, "unsupported_parameter", row.name)
            for v in row.neutral:  # null (and 1 for best_of, "" for suffix) = absent
                assert _err(endpoint, **{row.name: v}) is None, (row.name, v)


def test_a_field_of_the_other_endpoint_says_so():
    e = _err(rf.CHAT, echo=True)
    assert e.code == "unknown_parameter" and "/v1/completions" in e.message
    e = _err(rf.COMPLETIONS, tools=[])
    assert e.code == "unknown_parameter" and "/v1/chat/completions" in e.message


def test_harmless_fields_are_typed():
    assert _err(rf.CHAT, user="u", metadata={"a": "b"}, store=False, service_tier="auto",
                safety_identifier="s", prompt_cache_key="k", prediction={"type": "content",
                                                                         "content": "x"}) is None
    e = _err(rf.CHAT, metadata={"a": 1})
    assert (e.code, e.param) == ("invalid_value", "metadata.a")


def test_n_is_bounded():
    assert _err(rf.CHAT, n=16) is None and _err(rf.COMPLETIONS, n=3) is None
    e = _err(rf.CHAT, n=17)
    assert (e.status, e.param) == (400, "n")
