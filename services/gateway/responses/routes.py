"""The OpenAI Responses endpoints: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A thin translation onto the one request path (request_path.admit): the body is
validated (responses/schemas.py) and translated into the internal request
(responses/translate.py) — a `previous_response_id`'s stored conversation first —
admitted exactly as a chat completion is (chat template, tool parser, grammar,
logprobs, sampling defaults, admission, prefix cache), and its Generation's events
rendered as a response object or typed event stream (responses/stream.py). Release and disconnect are as chat's: a client
that goes away mid-stream aborts the request on every rank at once; nothing of it is
stored.

`background: true` runs it past its request (responses/background.py): GET shows it,
`POST /v1/responses/{id}/cancel` aborts it on every rank. Errors are in OpenAI's shape;
an unknown or expired id is a 404.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.core.admit_wait import pick_or_wait
from services.gateway.core.auth import check_api_key
from services.gateway.core.errors import ApiError
from services.gateway.core.generation import Final, Finish
from services.gateway.core.request_path import ClientGone, admit
from services.gateway.responses import schemas, translate
from services.gateway.responses.background import Background
from services.gateway.responses.store import ResponseStore, output_as_input
from services.gateway.responses.stream import Envelope, Output, collect, error_of, status_of, stream
from services.gateway.responses.tools import namespaced

ENDPOINT = "responses"  # the metrics label
router = APIRouter()


def store_of(app: FastAPI) -> ResponseStore:
    """The gateway's response store (one per app, made on first use)."""
    st = getattr(app.state, "response_store", None)
    if st is None:
        st = app.state.response_store = ResponseStore()
    return st


def background_of(app: FastAPI) -> Background:
    """The gateway's running background responses (one per app, made on first use)."""
    bg = getattr(app.state, "responses_background", None)
    if bg is None:
        bg = app.state.responses_background = Background()
    return bg


def not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id {rid!r} not found (never stored, deleted, or past "
                    "the store's retention).", param=param, code="not_found")


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request) -> dict:
    check_api_key(request)
    if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        raise ApiError(400, "stream: replaying a stored response as events is not supported; "
                       "GET without it returns the response", param="stream",
                       code="unsupported_parameter")
    running = background_of(request.app).snapshot(rid)
    if running is not None:
        return running
    s = store_of(request.app).get(rid)
    if s is None:
        raise not_found(rid)
    return s.response


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request) -> dict:
    check_api_key(request)
    if not store_of(request.app).delete(rid):
        raise not_found(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}


@router.post("/v1/responses/{rid}/cancel")
async def cancel_response(rid: str, request: Request) -> dict:
    check_api_key(request)
    body = await background_of(request.app).cancel(rid)
    if body is not None:
        return body
    s = store_of(request.app).get(rid)
    if s is None:
        raise not_found(rid)
    if not s.response.get("background"):
        raise ApiError(400, "only a background response can be cancelled (close a stream to "
                       "stop it)", param="response_id", code="invalid_value")
    return s.response  # it had ended already


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    gw = request.app.state.gw
    started = time.monotonic()
    check_api_key(request)
    s = gw.settings
    raw = await request.body()
    req = await gw.prepare_pool.parse(len(raw), schemas.validate, raw,
                                      max_messages=s.max_messages, max_tools=s.max_tools)
    store = store_of(request.app)
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.items
    try:
        internal = await gw.prepare_pool.run(translate.to_internal, req, history)
        if req.reasoning is not None and req.reasoning.effort is not None:
            internal = translate.apply_reasoning(internal, req, await gw.tokenizer(
                (await pick_or_wait(gw, request, req.model, 1))[0]))
        run = await admit(request, internal, rid_prefix="resp_", endpoint=ENDPOINT,
                          started=started, prompt_param="messages")
    except ApiError as e:
        raise translate.renamed(e) from None
    gen, rid = run.gens[0], run.rid
    env = Envelope(rid, run.backend.model, req)
    out = Output(logprobs=req.wants_logprobs(), max_calls=req.max_tool_calls,
                 namespaces=namespaced(req.tools))
    conversation = [*history, *translate.input_items(req)]

    def keep(body: dict) -> None:
        if req.stored() and body["status"] in ("completed", "incomplete"):
            body["store"] = store.put(rid, body, conversation + output_as_input(body["output"]))

    if req.background:
        return JSONResponse(background_of(request.app).start(run, out, env, conversation, store,
                                                             run.count), headers=run.headers)

    if req.stream:
        def on_end(final: Final, body: dict) -> None:
            run.streams[0].release()
            run.count(final)
            keep(body)

        return run.stream(stream(gen, out, env, on_end))

    try:
        final = await run.collect(request, collect(gen, out))
    except ClientGone:
        return Response(status_code=499)
    run.count(final)
    if final.error is not None:
        final.error.headers = {**run.headers, **(final.error.headers or {})}  # retry-after
        raise final.error
    if final.finish_reason == Finish.ABORT:
        raise ApiError(503, error_of(final)["message"], code="aborted", headers=run.headers)
    body = env.body(status_of(final), out.items, final)
    keep(body)
    return JSONResponse(body, headers=run.final_headers())
