"""The OpenAI endpoints: /v1/models, /v1/chat/completions, /v1/completions.

One request: authenticate → validate → pick a serving deployment for `model` →
tokenize (chat template) → GENERATE to rank 0 → stream or collect. From the moment the
GENERATE is sent the stream is released exactly once, whatever happens: normal end,
client disconnect (ABORT at once), server shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common import model_ref
from common.messages import Generate
from common.sampling_defaults import FIELDS
from services.gateway import choices
from services.gateway.errors import ApiError
from services.gateway.generation import Final, Generation
from services.gateway.openai_schemas import ChatRequest, CompletionRequest, validate
from services.gateway.prompts import output_parser, prompt_ids, token_limit
from services.gateway.sampling_params import generate_fields
from services.gateway.streaming import EventStreamResponse, Shape
from services.gateway.structured import grammar_for

router = APIRouter()


def check_api_key(request: Request) -> None:
    keys = request.app.state.gw.settings.api_keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("bearer "):
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    given = auth[7:].strip().encode()
    # Every key compared, each in constant time: neither a key nor which one matched leaks.
    if sum(hmac.compare_digest(given, k.encode()) for k in keys) == 0:
        raise ApiError(401, "invalid API key", code="invalid_api_key")


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    check_api_key(request)
    seen: dict[str, dict] = {}
    for d in request.app.state.gw.cluster.models():
        # `sampling_defaults` (an extension): what a request that names none gets
        seen.setdefault(d["model"], {"id": d["model"], "object": "model",
                                     "created": _created(d.get("model_path")),
                                     "owned_by": model_ref.owner(d["model"]),
                                     "sampling_defaults": _defaults(d.get("sampling"))})
    return {"object": "list", "data": list(seen.values())}


def _defaults(sampling: object) -> dict:
    """The deployment's defaults as /v1/models shows them: values and where each came from."""
    d = sampling if isinstance(sampling, dict) else {}
    return {k: d[k] for k in (*FIELDS, "origin") if k in d}


def _created(model_path: str | None) -> int:
    """When the model's files were written (its config.json), as OpenAI's `created`."""
    try:
        return int((Path(model_path) / "config.json").stat().st_mtime) if model_path else 0
    except OSError:
        return 0


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    check_api_key(request)
    for m in (await list_models(request))["data"]:
        if m["id"] == model_id:
            return m
    raise ApiError(404, f"model {model_id!r} not found", param="model", code="model_not_found")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def _handle(request: Request, *, chat: bool) -> Response:
    gw = request.app.state.gw
    started = time.monotonic()
    endpoint = "chat" if chat else "completions"
    check_api_key(request)
    s = gw.settings
    # Only reading the (capped) body happens here; parsing a large one, the chat
    # template and tokenizing run in gw.prepare_pool's few threads (docs/gateway.md, bounds).
    raw = await request.body()
    req = await gw.prepare_pool.parse(len(raw), validate, ChatRequest if chat else CompletionRequest,
                                 raw, max_messages=s.max_messages, max_tools=s.max_tools)
    backend = gw.pick(req.model)
    tok = await gw.tokenizer(backend)
    prompt = await gw.prepare_pool.run(prompt_ids, req, tok, s.input_bytes_per_token)
    ids, prefix = prompt.ids, prompt.echo
    if not ids:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt",
                       code="invalid_value")
    ctx = tok.context_len
    if ctx and len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {ctx}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    limit = token_limit(req.limit(), gw.settings.default_max_tokens, ctx, len(ids))
    grammar = await gw.prepare_pool.run(grammar_for, req, tok) if chat else ""  # structured output
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    gen_msg = Generate(
        request_id=rid, prompt=ids, max_tokens=limit,
        seed=None if req.seed is None else req.seed % (2**63),
        stop_token_ids=list(tok.eos_ids), client="gateway", grammar=grammar,
        **generate_fields(req, tok, backend.sampling, chat=chat))
    n = req.n or 1
    streams = await choices.open_streams(backend, gen_msg, n)  # 503 Unavailable: retry-after
    gens = [Generation(st, tok, model=backend.model, stops=req.stops(),
                       parser=output_parser(req, tok, prompt) if chat else None,
                       started_at=started, read_timeout=gw.settings.request_read_timeout,
                       keepalive_s=gw.settings.keepalive_s, metrics=gw.metrics,
                       one_call=chat and req.parallel_tool_calls is False) for st in streams]
    shape = Shape(chat, rid, backend.model, req.include_usage(), logprobs=gen_msg.top_logprobs >= 0)
    headers = {"x-lockstep-request-id": rid, "x-lockstep-deployment": backend.deployment_id}

    def done(final: Final | None, outcome: str | None = None) -> None:
        gw.metrics.requests.labels(endpoint=endpoint, model=backend.model,
                                   outcome=outcome or _outcome(final)).inc()

    def release_all(reason: str) -> None:
        for st in streams:
            st.release(reason)  # no-op for a stream already released

    if req.stream:
        ended: dict[int, Final] = {}
        counted: list[bool] = []  # the request's outcome is counted once

        def count(final: Final | None, outcome: str | None = None) -> None:
            if not counted:
                counted.append(True)
                done(final, outcome)

        def on_end(i: int, final: Final) -> None:
            streams[i].release()
            ended[i] = final
            if len(ended) == n or final.error is not None:
                count(choices.merged_final([ended[k] for k in sorted(ended)]))

        def on_disconnect() -> None:
            if any(not st.released for st in streams):
                release_all("client_disconnect")
                count(None, "client_disconnect")

        async def body():
            try:
                async for chunk in choices.sse_choices(gens, shape, prefix, on_end):
                    yield chunk
            finally:
                on_disconnect()

        return EventStreamResponse(body(), on_disconnect, headers)

    try:
        results = await _until_disconnect(request, choices.collect_all(gens, prefix))
    except _ClientGone:
        release_all("client_disconnect")
        done(None, "client_disconnect")
        return Response(status_code=499)
    finally:
        release_all("client_disconnect")  # no-op after a normal end
    final = choices.merged_final([f for _, _, f in results])
    done(final)
    if final.error is not None:
        final.error.headers = {**headers, **(final.error.headers or {})}  # keeps retry-after
        raise final.error
    headers["x-lockstep-ttft-model-ms"] = _hdr(final.model_ttft_ms)
    headers["x-lockstep-ttft-visible-ms"] = _hdr(final.visible_ttft_ms)
    return JSONResponse(choices.body(shape, results), headers=headers)


def _outcome(final: Final | None) -> str:
    if final is None:
        return "unknown"
    if final.error is not None:
        return final.error.code or "error"
    return final.finish_reason


def _hdr(ms: float | None) -> str:
    return "" if ms is None else f"{ms:.3f}"


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it and raise _ClientGone."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise _ClientGone()
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
