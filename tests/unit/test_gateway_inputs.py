"""The gateway's input checks as pure functions: JSON depth (strings and escapes do not
count), lone surrogates named by path, and bodies crafted to make a scanner slow."""

from __future__ import annotations

import json

import pytest

from services.gateway.core.errors import ApiError
from services.gateway.core.jsonguard import lone_surrogate, too_deep
from services.gateway.core.request_body import MAX_JSON_DEPTH, parse_json


def nest(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


@pytest.mark.parametrize("raw, deep", [
    (nest(64), False),
    (nest(65), True),
    (b'{"a": ' * 64 + b"1" + b"}" * 64, False),
    (b'{"a": ' * 65 + b"1" + b"}" * 65, True),
    (b"[" + b"[]," * 10_000 + b"[]]", False),  # wide, not deep
    (b'["' + b"[" * 500 + b'"]', False),  # brackets inside a string do not nest
    (b'["\\"' + b"[" * 500 + b'\\\\"]', False),  # nor after escaped quotes and backslashes
    (b'[{"a": [{"b": ' * 16 + b"0" + b"}]}]" * 16, False),  # 64 exactly, mixed
    (b'[{"a": [{"b": ' * 17 + b"0" + b"}]}]" * 17, True),
])
def test_depth_is_counted_on_structure_only(raw, deep):
    json.loads(raw)  # every case is valid JSON
    assert too_deep(raw, 64) is deep


def test_deep_bodies_are_400_however_deep():
    for raw in (nest(65), nest(900), nest(100_000)):  # under and over Python's recursion limit
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert err.value.status == 400 and err.value.code == "invalid_json"
        assert f"deeper than {MAX_JSON_DEPTH}" in err.value.message


@pytest.mark.timeout(30)
def test_crafted_malformed_bodies_are_refused_in_linear_time():
    """Each of these is 4 MB; a backtracking scan of the first is quadratic (minutes)."""
    for raw in (b'"\\' * 2_000_000, b'"' + b"a" * 4_000_000, b"[{" * 2_000_000,
                b'"\\"' * 1_300_000):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert err.value.code == "invalid_json"


def test_lone_surrogates_are_named_by_path():
    def path(obj):
        raw = json.dumps(obj).encode()
        return lone_surrogate(raw, json.loads(raw))

    assert path({"prompt": "a\udfff"}) == "prompt"
    assert path({"messages": [{"content": "ok"}, {"content": [{"text": "\ud800x"}]}]}) == \
        "messages.1.content.0.text"
    assert path({"tools": [{"function": {"parameters": {"\udc00": 1}}}]}) == \
        "tools.0.function.parameters.?"
    assert path({"prompt": "rocket \ud83d\ude80"}) is None  # a pair is one character
    assert path({"prompt": "\\ud800 is only text here"}) is None  # an escaped backslash
    assert lone_surrogate(b'{"p": "x"}', {"p": "x"}) is None
    with pytest.raises(ApiError) as err:
        parse_json(json.dumps({"stop": ["a", "\udbff"]}).encode())
    assert (err.value.status, err.value.param, err.value.code) == (400, "stop.1", "invalid_value")
