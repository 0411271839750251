"""API keys: every API's requests are checked the same way (OpenAI's header or Anthropic's)."""

from __future__ import annotations

import hmac

from fastapi import Request

from services.gateway.core.errors import ApiError


def check_api_key(request: Request) -> None:
    keys = request.app.state.gw.settings.api_keys
    if not keys:
        return
    # `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
    auth = request.headers.get("authorization", "")
    given = [auth[7:].strip().encode()] if auth.lower().startswith("bearer ") else []
    if "x-api-key" in request.headers:
        given.append(request.headers["x-api-key"].strip().encode())
    if not given:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>'", code="invalid_api_key")
    # Every key compared, each in constant time: neither a key nor which one matched leaks.
    if sum(hmac.compare_digest(g, k.encode()) for g in given for k in keys) == 0:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
