"""API keys: every API's requests are checked the same way (OpenAI's header or Anthropic's),
and each key is a tenant with a name, a weight and a highest priority (issue 45).

`LOCKSTEP_API_KEYS` entries are `key` or `name:key` (an unnamed key is named `key-<i>`,
its position); `LOCKSTEP_API_KEY_WEIGHTS` (`name=w`, default 1) weights a key's turn in
rank 0's queue within a priority and its share of the in-flight bound;
`LOCKSTEP_API_KEY_MAX_PRIORITY` (`name=p`) is the most urgent priority the key may ask
(lower is more urgent; none: any). A request names its tenant to rank 0 by the key's
name, never the key.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from common.config import ConfigError
from services.gateway.core.errors import ApiError

MAX_WEIGHT = 1000  # rank 0's bound too (services/rank/leader.py)


@dataclass(frozen=True)
class Tenant:
    name: str  # "" while the gateway is open (no keys)
    weight: int = 1
    max_priority: int | None = None  # the most urgent priority it may ask; None: any


OPEN = Tenant("")


@dataclass(frozen=True)
class KeyTable:
    keys: tuple[tuple[bytes, Tenant], ...] = ()

    @property
    def total_weight(self) -> int:
        return sum(t.weight for _, t in self.keys)

    @classmethod
    def parse(cls, keys: tuple[str, ...], weights: tuple[str, ...] = (),
              max_priority: tuple[str, ...] = ()) -> KeyTable:
        named = []
        for i, entry in enumerate(keys):
            name, sep, key = entry.partition(":")
            if not sep:
                name, key = f"key-{i}", entry
            if not name or not key:
                raise ConfigError(f"api_keys: entry {i} must be KEY or NAME:KEY")
            named.append((name, key))
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError(f"api_keys: a name is given twice ({names})")
        w = _pairs("api_key_weights", weights, names, 1, MAX_WEIGHT)
        p = _pairs("api_key_max_priority", max_priority, names, -(1 << 20), 1 << 20)
        return cls(tuple((k.encode(), Tenant(n, w.get(n, 1), p.get(n))) for n, k in named))


def _pairs(setting: str, entries: tuple[str, ...], names: list[str], lo: int,
           hi: int) -> dict[str, int]:
    out = {}
    for e in entries:
        name, sep, value = e.partition("=")
        if not sep or name not in names:
            raise ConfigError(f"{setting}: {e!r} must be NAME=INTEGER for a key named in "
                              f"api_keys ({', '.join(names) or 'none'})")
        try:
            v = int(value)
        except ValueError:
            raise ConfigError(f"{setting}: {e!r}: {value!r} is not an integer") from None
        if not lo <= v <= hi:
            raise ConfigError(f"{setting}: {e!r} must be in [{lo}, {hi}]")
        out[name] = v
    return out


def check_api_key(request: Request) -> Tenant:
    """The request's tenant (OPEN when the gateway has no keys), also kept on
    `request.state.tenant`; 401 without a valid key."""
    table: KeyTable = request.app.state.gw.keys
    if not table.keys:
        request.state.tenant = OPEN
        return OPEN
    # `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
    auth = request.headers.get("authorization", "")
    given = [auth[7:].strip().encode()] if auth.lower().startswith("bearer ") else []
    if "x-api-key" in request.headers:
        given.append(request.headers["x-api-key"].strip().encode())
    if not given:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>'", code="invalid_api_key")
    # Every key compared, each in constant time: neither a key nor which one matched leaks.
    found = None
    for key, tenant in table.keys:
        if sum(hmac.compare_digest(g, key) for g in given):
            found = found or tenant
    if found is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    request.state.tenant = found
    return found
