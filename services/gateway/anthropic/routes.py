"""The Anthropic Messages endpoints: `POST /v1/messages` and `/v1/messages/count_tokens`.

A thin translation onto the one request path (request_path.admit): the body is
validated (anthropic/schemas.py) and translated into the internal request (anthropic/translate.py), admitted exactly as
a chat completion is (chat template, tool parser, grammar, sampling defaults, admission,
prefix cache), and its Generation's events rendered as Anthropic's message or event
stream (anthropic/render.py). Release and disconnect are as chat's: a client that goes
away mid-stream aborts the request on every rank at once.

Errors on these routes are in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`), wherever they are rendered (handlers, the body cap, the catch-all:
errors.SHAPES); the OpenAI routes keep theirs.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.anthropic import render, schemas, translate
from services.gateway.core.admit_wait import pick_or_wait
from services.gateway.core.auth import check_api_key
from services.gateway.core.errors import SHAPES
from services.gateway.core.gateway_core import names
from services.gateway.core.generation import Final, Finish
from services.gateway.core.internal_request import GenerationRequest
from services.gateway.core.prompts import prompt_ids
from services.gateway.core.request_channel import Backend, Overloaded
from services.gateway.core.request_path import ClientGone, admit

ENDPOINT = "messages"  # the metrics label


router = APIRouter()
SHAPES["/v1/messages"] = render.error_response  # every error under /v1/messages: Anthropic's


async def _parse(request: Request, endpoint: str) -> schemas.CountTokensRequest:
    gw = request.app.state.gw
    check_api_key(request)
    s = gw.settings
    raw = await request.body()
    return await gw.prepare_pool.parse(len(raw), schemas.validate, raw, endpoint,
                                       max_messages=s.max_messages, max_tools=s.max_tools)


async def _backend(request: Request, model: str) -> Backend:
    """The deployment serving `model`, for what needs only its tokenizer (a full one
    still answers count_tokens)."""
    gw = request.app.state.gw
    try:
        return (await pick_or_wait(gw, request, model, 1))[0]  # through a redeploy too
    except Overloaded:
        return next(b for b in gw.cluster.backends.values() if names(b, model) and not b.lost)


async def _checked(request: Request, req: schemas.CountTokensRequest) -> GenerationRequest:
    """The internal request, after what only the model can answer (thinking, effort)."""
    gw = request.app.state.gw
    internal = await gw.prepare_pool.run(translate.to_internal, req)
    if req.thinking is not None or (req.output_config and req.output_config.effort):
        tok = await gw.tokenizer(await _backend(request, req.model))
        schemas.check_model(req, tok)
        if "reasoning_effort" not in tok.fmt.template_vars:  # the default, honoured as is
            internal = internal.with_input(reasoning_effort=None)
    return internal


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    """The prompt's tokens as /v1/messages would send them: the same translation, chat
    template and tokenizer; nothing is generated."""
    gw = request.app.state.gw
    req = await _parse(request, schemas.COUNT)
    chat = await _checked(request, req)
    tok = await gw.tokenizer(await _backend(request, req.model))
    prompt = await gw.prepare_pool.run(prompt_ids, chat, tok, gw.settings.input_bytes_per_token)
    return JSONResponse({"input_tokens": len(prompt.ids)})


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    started = time.monotonic()
    req = await _parse(request, schemas.CREATE)
    chat = await _checked(request, req)
    run = await admit(request, chat, rid_prefix="msg_", endpoint=ENDPOINT,
                      started=started, prompt_param="messages")
    gen, rid, model = run.gens[0], run.rid, run.backend.model
    blocks = render.Blocks("lockstep." + rid, omit_thinking=schemas.omit_thinking(req))
    prompt_tokens = len(run.prompt.ids)
    headers = {**run.headers, "request-id": rid}

    if req.stream:
        def on_end(final: Final) -> None:
            run.streams[0].release()
            run.count(final)

        return run.stream(render.stream(gen, blocks, rid, model, prompt_tokens, on_end), headers)

    try:
        final = await run.collect(request, render.collect(gen, blocks))
    except ClientGone:
        return Response(status_code=499)
    run.count(final)
    headers = {**run.final_headers(), "request-id": rid}
    error = final.error or (render.aborted(final) if final.finish_reason == Finish.ABORT
                            else None)
    if error is not None:
        error.headers = {**headers, **(error.headers or {})}  # keeps retry-after
        return render.error_response(error, rid)
    reason, seq = render.stop_reason(final, gen)
    return JSONResponse(render.message(rid, model, blocks.blocks, reason, seq,
                                       render.usage(final, prompt_tokens)), headers=headers)
