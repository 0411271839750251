"""Checks on a JSON request body that must come before anything recurses or encodes it.

- `too_deep(raw, limit)`: the nesting depth of the raw bytes, found without recursion and
  without a Python loop per byte: strings are cut out by one regex, each bracket becomes
  a +1/-1 step (every other byte 0) by one `translate`, and the depth is the running
  sum's maximum (numpy): ~0.1 s for 4 MB of brackets. Call it on a body json.loads
  accepted (json.loads itself stops at Python's recursion limit with RecursionError):
  in valid JSON every string ends, so the regex never retries from a later quote, which
  on a crafted malformed body (`"\\"\\"\\...`) would be quadratic.
- `lone_surrogate(raw, obj)`: the path of the first string holding a lone UTF-16
  surrogate. JSON can carry one only as a `\\uD800`-`\\uDFFF` escape, so a byte search
  of the raw body rules out almost every request; only a body with such an escape is
  walked (iteratively) to name the field. Such a string cannot be encoded as UTF-8: the
  tokenizer and every JSON response would fail on it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# A JSON string literal, escapes included (the unrolled form: no backtracking blow-up).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte to its depth step: an opener +1, a closer -1 (int8 0xff), anything else 0.
_STEPS = bytes(1 if b in b"[{" else 0xFF if b in b"]}" else 0 for b in range(256))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")
_LONE = re.compile("[\ud800-\udfff]")


def too_deep(raw: bytes, limit: int) -> bool:
    """True if the (valid) JSON in `raw` nests arrays/objects more than `limit` deep."""
    steps = np.frombuffer(_STRING.sub(b"", raw).translate(_STEPS), dtype=np.int8)
    return bool(steps.size) and int(np.cumsum(steps, dtype=np.int32).max()) > limit


def lone_surrogate(raw: bytes, obj: Any) -> str | None:
    """The dotted path ("messages.0.content") of a string or key with a lone surrogate."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack: list[tuple[Any, tuple]] = [(obj, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _LONE.search(node):
                return ".".join(str(p) for p in path) or "(body)"
        elif isinstance(node, dict):
            for k, v in node.items():
                if _LONE.search(k):
                    return ".".join(str(p) for p in (*path, k.encode("utf-8", "replace")
                                                     .decode()))
                stack.append((v, (*path, k)))
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
    return None
