"""The OpenAI endpoints: /v1/models, /v1/chat/completions, /v1/completions.

One request: authenticate → validate → pick a serving deployment for `model` →
tokenize (chat template) → GENERATE to rank 0 → stream or collect. From the moment the
GENERATE is sent the stream is released exactly once, whatever happens: normal end,
client disconnect (ABORT at once), server shutdown.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common import model_ref
from common.sampling_defaults import FIELDS, SamplingDefaults
from common.schema import to_wire
from services.gateway.core import choices
from services.gateway.core.auth import check_api_key
from services.gateway.core.errors import ApiError
from services.gateway.core.generation import Final
from services.gateway.core.request_path import ClientGone, admit
from services.gateway.core.streaming import Shape
from services.gateway.openai.schemas import ChatRequest, CompletionRequest, validate
from services.gateway.openai.translate import from_chat, from_completion

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    check_api_key(request)
    seen: dict[str, dict] = {}
    for d in request.app.state.gw.cluster.models():
        # `sampling_defaults` (an extension): what a request that names none gets
        seen.setdefault(d.model, {"id": d.model, "object": "model",
                                  "created": _created(d.model_path),
                                  "owned_by": model_ref.owner(d.model),
                                  "sampling_defaults": _defaults(d.sampling),
                                  # "on" | "unverified" | "off": the batch-invariant pass
                                  "determinism": d.determinism and d.determinism.value,
                                  # "off" | "ngram": rank 0's drafts, verified in one step
                                  "speculation": d.speculation and d.speculation.value})
    return {"object": "list", "data": list(seen.values())}


def _defaults(sampling: SamplingDefaults) -> dict:
    """The deployment's defaults as /v1/models shows them: values and where each came from."""
    d = to_wire(sampling)
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
    check_api_key(request)
    s = gw.settings
    # Only reading the (capped) body happens here; parsing a large one, the chat
    # template and tokenizing run in gw.prepare_pool's few threads (docs/gateway.md, bounds).
    raw = await request.body()
    req = await gw.prepare_pool.parse(len(raw), validate, ChatRequest if chat else CompletionRequest,
                                 raw, max_messages=s.max_messages, max_tools=s.max_tools)
    internal = await gw.prepare_pool.run(
        from_chat if isinstance(req, ChatRequest) else from_completion, req)  # per message: off the loop
    run = await admit(request, internal, rid_prefix="chatcmpl-" if chat else "cmpl-",
                      endpoint="chat" if chat else "completions", started=started)
    rid, backend, streams, gens, n = run.rid, run.backend, run.streams, run.gens, len(run.gens)
    prefix = run.prompt.echo
    shape = Shape(chat, rid, backend.model, req.include_usage(),
                  logprobs=run.message.top_logprobs >= 0)
    headers = dict(run.headers)

    if req.stream:
        ended: dict[int, Final] = {}

        def on_end(i: int, final: Final) -> None:
            streams[i].release()
            ended[i] = final
            if len(ended) == n or final.error is not None:
                run.count(choices.merged_final([ended[k] for k in sorted(ended)]))

        return run.stream(choices.sse_choices(gens, shape, prefix, on_end), headers)

    try:
        results = await run.collect(request, choices.collect_all(gens, prefix))
    except ClientGone:
        return Response(status_code=499)
    final = choices.merged_final([f for _, _, f in results])
    run.count(final)
    headers = run.final_headers()
    if final.error is not None:
        final.error.headers = {**headers, **(final.error.headers or {})}  # keeps retry-after
        raise final.error
    headers["x-lockstep-ttft-model-ms"] = _hdr(final.model_ttft_ms)
    headers["x-lockstep-ttft-visible-ms"] = _hdr(final.visible_ttft_ms)
    return JSONResponse(choices.body(shape, results), headers=headers)


def _hdr(ms: float | None) -> str:
    return "" if ms is None else f"{ms:.3f}"
