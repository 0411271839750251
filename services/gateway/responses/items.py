"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from,
as OpenAI's endpoint lists them (what `client.responses.input_items.list` pages through).

The items are the whole conversation the model saw before its output, as OpenAI's
(`previous_response_id` chains included): the earlier responses' input and output items,
then this response's own input; never its `instructions`, never its own output. Each
item has the id it was given when first stored (response_store.with_ids), so an item
lists under the same id in every response of a chain.

Query parameters, as the `openai` SDK's `InputItemListParams` (and the older reference's
`before`): `limit` 1..100 (default 20), `order` `asc` | `desc` (default `desc`, newest
first), `after` / `before` an item id of this list (a cursor: the items after / before
it in that order), `include` one of OpenAI's includables (nothing stored here carries
what they add: accepted, no effect). Anything else, or a bad value, is a 400 naming the
parameter; an unknown, deleted or expired response is the 404 GET gives.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from services.gateway.core.auth import check_api_key
from services.gateway.core.errors import ApiError
from services.gateway.responses.routes import not_found, store_of

router = APIRouter()

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
# openai's ResponseIncludable (types/responses/response_includable.py).
INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content",
    "message.output_text.logprobs"})
PARAMS = ("limit", "order", "after", "before", "include")


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _parts(content: str | list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    out = []
    for p in content:
        p = {k: v for k, v in p.items() if v is not None}
        if p.get("type") == "output_text":
            p.setdefault("annotations", [])
        out.append(p)
    return out


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item in the shape OpenAI lists it (the SDK's `ResponseItem`)."""
    kind = item.get("type") or "message"
    base = {"id": item["id"], "type": kind}
    if kind == "message":
        role = item["role"]
        text = "output_text" if role == "assistant" else "input_text"
        return {**base, "role": role, "content": _parts(item["content"], text),
                "status": "completed"}
    if kind == "function_call":
        return {**base, "call_id": item["call_id"], "name": item["name"],
                **({"namespace": item["namespace"]} if item.get("namespace") else {}),
                "arguments": item["arguments"], "status": "completed"}
    if kind == "function_call_output":
        return {**base, "call_id": item["call_id"], "output": item["output"],
                "status": "completed"}
    # reasoning
    return {**base, "summary": item.get("summary") or [],
            **({"content": item["content"]} if item.get("content") else {})}


def _position(items: list[dict[str, Any]], cursor: str, param: str) -> int:
    for i, it in enumerate(items):
        if it["id"] == cursor:
            return i
    raise _bad(param, f"no item with id {cursor!r} in this response's input items")


def page(items: list[dict[str, Any]], *, limit: int = DEFAULT_LIMIT, order: str = "desc",
         after: str | None = None, before: str | None = None) -> dict[str, Any]:
    """One page of `items` (stored order: oldest first) as OpenAI's `list` object."""
    seq = items if order == "asc" else items[::-1]
    lo, hi = 0, len(seq)
    if after is not None:
        lo = _position(seq, after, "after") + 1
    if before is not None:
        hi = _position(seq, before, "before")
    window = seq[lo:hi] if lo < hi else []
    # `before` alone pages backwards: the `limit` items nearest the cursor.
    chosen = window[-limit:] if before is not None and after is None else window[:limit]
    data = [listed(it) for it in chosen]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(window) > len(chosen)}


def parse_query(request: Request) -> dict[str, Any]:
    """The query parameters, checked; a 400 names the first bad one."""
    q = request.query_params
    for k in q:
        if k not in PARAMS and k != "include[]":
            raise _bad(k, "unknown parameter (supported: limit, order, after, before, include)",
                       "unknown_parameter")
    out: dict[str, Any] = {}
    if "limit" in q:
        raw = q["limit"]
        if not raw.lstrip("-").isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            raise _bad("limit", f"must be an integer from 1 to {MAX_LIMIT}, got {raw!r}")
        out["limit"] = int(raw)
    if "order" in q:
        if q["order"] not in ("asc", "desc"):
            raise _bad("order", f"must be 'asc' or 'desc', got {q['order']!r}")
        out["order"] = q["order"]
    for k in ("after", "before"):
        if k in q:
            if not q[k]:
                raise _bad(k, "must be an item id")
            out[k] = q[k]
    for v in q.getlist("include") + q.getlist("include[]"):
        if v not in INCLUDABLE:
            raise _bad("include", f"{v!r} is not one of {', '.join(sorted(INCLUDABLE))}")
    return out


@router.get("/v1/responses/{rid}/input_items")
async def list_input_items(rid: str, request: Request) -> dict:
    check_api_key(request)
    args = parse_query(request)  # a bad parameter is a 400 even for an unknown id
    s = store_of(request.app).get(rid)
    if s is None:
        raise not_found(rid)
    return page(s.input_items(), **args)
