"""A request body, any API's: parsed as JSON within bounds before any schema sees it, and
the limits every API's schema shares."""

from __future__ import annotations

import json

from services.gateway.core.errors import ApiError
from services.gateway.core.internal_request import Json
from services.gateway.core.jsonguard import lone_surrogate, too_deep

MAX_STOPS = 16
MAX_JSON_DEPTH = 64  # nesting of any request body (tool schemas included)
MAX_MESSAGES = 4096  # defaults of the gateway settings max_messages / max_tools
MAX_TOOLS = 128


def parse_json(raw: bytes) -> Json:
    """The body as JSON: at most MAX_JSON_DEPTH deep, every string valid Unicode."""
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    too_deep_error = ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels",
                              code="invalid_json")
    try:
        obj = json.loads(raw)  # linear; recursion bounded by Python's limit
    except RecursionError:
        raise too_deep_error from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if too_deep(raw, MAX_JSON_DEPTH):  # before pydantic, templates or responses recurse
        raise too_deep_error
    bad = lone_surrogate(raw, obj)
    if bad is not None:
        raise ApiError(400, f"invalid value for '{bad}': a lone UTF-16 surrogate (\\uD800-\\uDFFF) "
                       "is not text", param=bad, code="invalid_value")
    return obj
