"""A valid, non-default value of each declared request parameter
(common/request_params.py), for the tests that walk every field of an API."""

from __future__ import annotations

from common.request_params import Param, params_in


def sample(p: Param, api: str) -> float | dict[str, float]:
    """Inside `p`'s range in `api` and not its "off" value (so it is seen to arrive)."""
    b = p.bounds_in(api)
    if p.kind is dict:
        return {"1": 1.5, "2": -3.0}
    lo = b.lo if b.lo is not None else 0
    hi = b.hi if b.hi is not None else lo + 2
    value = p.kind(lo + (hi - lo) / 3) if p.kind is float else p.kind(lo + 1)
    return value if value != p.off else p.kind(value + (hi - lo) / 7)


def samples(api: str) -> dict[str, float | dict[str, float]]:
    return {p.name: sample(p, api) for p in params_in(api)}
