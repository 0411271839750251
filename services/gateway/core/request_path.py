"""The one request path under every API: a validated request (OpenAI chat or completion
form) → a serving deployment → tokens (chat template) → GENERATE to rank 0 → one
Generation per choice. Chat and text completions (openai/routes.py) and every API that
translates into the chat form use it, so tokenizing, tool parsers, grammar, logprobs,
sampling defaults, admission and the prefix cache are written once.

From `admit`'s return the streams are open on rank 0, and the `Admitted` it returns
owns what every API does with them: each stream released exactly once (normal end,
client disconnect, shutdown), the request's outcome counted once, a client that goes
away mid-stream or before its answer (ABORT at once, counted `client_disconnect`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from common import request_params
from common.messages import FinishReason, Generate
from common.request_params import SEED_MOD
from services.gateway.core import choices
from services.gateway.core.admit_wait import pick_or_wait
from services.gateway.core.auth import OPEN, Tenant
from services.gateway.core.errors import ApiError
from services.gateway.core.generation import Final, Generation
from services.gateway.core.internal_request import GenerationRequest
from services.gateway.core.metrics import Metrics
from services.gateway.core.prompts import Prompt, output_parser, prompt_ids, token_limit
from services.gateway.core.request_channel import Backend, RequestStream
from services.gateway.core.resume import Resumer
from services.gateway.core.router import Router
from services.gateway.core.sampling_params import sampling_for
from services.gateway.core.streaming import EventStreamResponse
from services.gateway.core.structured import grammar_for

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


@dataclass
class Admitted:
    """One request, admitted and running on rank 0."""

    rid: str
    backend: Backend
    prompt: Prompt
    message: Generate
    streams: list[RequestStream]
    gens: list[Generation]
    started: float
    endpoint: str  # the metrics label
    metrics: Metrics
    headers: dict[str, str] = field(default_factory=dict)
    router: Router | None = None  # services/gateway/core/router.py: told what the model finished
    counted: bool = False

    def final_headers(self) -> dict[str, str]:
        """A non-streamed answer's headers: the deployment that finished it (a resumed
        request's last one) and how often it resumed."""
        resumed = sum(g.resumer.resumes for g in self.gens if g.resumer is not None)
        return {**self.headers, "x-lockstep-deployment": self.gens[0].stream.backend.deployment_id,
                "x-lockstep-resumed": str(resumed)}

    def release_all(self, reason: str) -> None:
        for st in self.streams:
            st.release(reason)  # no-op for a stream already released

    def count(self, final: Final | None, outcome: str | None = None) -> None:
        """Count the request's outcome; only the first call counts."""
        if self.counted:
            return
        self.counted = True
        if self.router is not None and final is not None:
            for g in self.gens:  # what rank 0 keeps in its cache (a resumed one: where it ended)
                if g.stream.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    self.router.finished(g.stream.backend, [*self.message.prompt, *g.token_ids])
        self.metrics.requests.labels(endpoint=self.endpoint, model=self.backend.model,
                                     outcome=outcome or outcome_of(final)).inc()

    def client_gone(self) -> None:
        """The client left: ABORT every stream still running, count `client_disconnect`."""
        self.release_all("client_disconnect")
        self.count(None, "client_disconnect")

    def on_disconnect(self) -> None:
        """A streamed response closed (its client went away, or it ended): as
        `client_gone` while any stream still runs, else nothing."""
        if any(not st.released for st in self.streams):
            self.client_gone()

    def stream(self, chunks: AsyncIterator[bytes],
               headers: dict[str, str] | None = None) -> EventStreamResponse:
        """`chunks` as an SSE response whose close, however it comes, is `on_disconnect`."""
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                self.on_disconnect()

        return EventStreamResponse(body(), self.on_disconnect,
                                   self.headers if headers is None else headers)

    async def collect(self, request: Request, work: Awaitable[T]) -> T:
        """`work`'s result (a non-streamed answer), unless the client disconnects first:
        then it is cancelled, `client_gone`, and ClientGone raised (the route answers 499).
        Every stream is released when this returns."""
        try:
            return await until_disconnect(request, work)
        except ClientGone:
            self.client_gone()
            raise
        finally:
            self.release_all("client_disconnect")  # no-op after a normal end


async def until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Run `coro`; if the client disconnects first, cancel it and raise ClientGone."""
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
        raise ClientGone()
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()


def outcome_of(final: Final | None) -> str:
    if final is None:
        return "unknown"
    if final.error is not None:
        return final.error.code or "error"
    return str(final.finish_reason)  # the Finish value, a metrics label


PRIORITY_HEADER = "x-lockstep-priority"


def priority_of(request: Request, req: GenerationRequest, tenant: Tenant) -> int:
    """The request's priority: its body's `priority`, else the x-lockstep-priority header
    (for clients that cannot add a body field), else 0 (or the key's highest, if that is
    larger); the header checked as the field, both against the key's highest."""
    value = req.params.get("priority")
    top = tenant.max_priority
    if value is None:
        header = request.headers.get(PRIORITY_HEADER)
        if header is None:
            return 0 if top is None else max(0, top)
        try:
            value = int(header.strip())
        except ValueError:
            raise ApiError(400, f"{PRIORITY_HEADER}: an integer is expected, not {header!r}",
                           param="priority", code="invalid_value") from None
        if (why := request_params.problem("priority", value)) is not None:
            raise ApiError(400, f"{PRIORITY_HEADER}: {why}", param="priority",
                           code="invalid_value")
    if top is not None and value < top:
        raise ApiError(400, f"priority {value} is more urgent than this API key may ask "
                       f"(its highest is {top}; lower runs first)", param="priority",
                       code="invalid_value")
    return int(value)


def check_share(gw, tenant: Tenant, n: int) -> None:
    """429 once `tenant` holds its share of the in-flight bound (its weight's part of
    max_inflight, at least 1), counting its streams on every deployment."""
    if not tenant.name or not gw.settings.max_inflight:
        return
    share = max(1, gw.settings.max_inflight * tenant.weight // gw.keys.total_weight)
    held = sum(1 for b in gw.cluster.backends.values() for s in b.streams.values()
               if s.tenant == tenant.name)
    if held + n > share:
        raise ApiError(429, f"API key {tenant.name!r} has {held} requests in flight, its share "
                       f"of {gw.settings.max_inflight} is {share}: retry later",
                       code="tenant_share_exceeded", headers={"retry-after": "1"})


async def admit(request: Request, req: GenerationRequest, *, rid_prefix: str, endpoint: str,
                started: float | None = None, prompt_param: str | None = None) -> Admitted:
    """Pick, tokenize, check, send GENERATE (n choices): every refusal before rank 0 is an
    ApiError; `prompt_param` names the field a too-long or empty prompt is blamed on;
    `endpoint` labels the request's outcome in the metrics."""
    gw = request.app.state.gw
    started = time.monotonic() if started is None else started
    s = gw.settings
    chat = req.chat
    param = prompt_param or ("messages" if chat else "prompt")
    n = req.n
    tenant = getattr(request.state, "tenant", OPEN)  # auth.check_api_key set it
    priority = priority_of(request, req, tenant)
    cands = await pick_or_wait(gw, request, req.model, n)
    tok = await gw.tokenizer(cands[0])
    prompt = await gw.prepare_pool.run(prompt_ids, req, tok, s.input_bytes_per_token)
    ids = prompt.ids
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
    ctx = tok.context_len
    if ctx and len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {ctx}",
                       param=param, code="context_length_exceeded")
    limit = token_limit(req.max_tokens, s.default_max_tokens, ctx, len(ids))
    grammar = await gw.prepare_pool.run(grammar_for, req, tok) if chat else ""  # structured output
    # Replicas: the router chooses now that the prompt's tokens are known; no await
    # between this and the streams' registration, so the next request sees their load.
    route = gw.router.choose([b for b in cands if not b.lost and not b.closed] or cands, ids)
    check_share(gw, tenant, n)  # no await from here to the streams' registration
    backend = route.backend
    rid = rid_prefix + secrets.token_hex(12)
    # The seed is decided here, the one place: the client's, else drawn; a request that
    # resumes elsewhere goes on with the same one (services/gateway/core/resume.py).
    seed = secrets.randbelow(SEED_MOD) if req.seed is None else req.seed % SEED_MOD
    msg = Generate(
        request_id=rid, prompt=ids, max_tokens=limit,
        sampling=sampling_for(req.params, tok, backend.sampling, seed=seed, grammar=grammar),
        stop_token_ids=list(tok.eos_ids), client="gateway",
        top_logprobs=req.logprobs, priority=priority, tenant=tenant.name,
        tenant_weight=tenant.weight)
    streams = await choices.open_streams(backend, msg, n, route.cached)  # 503: retry-after
    gens = [Generation(st, tok, model=backend.model, stops=list(req.stops),
                       parser=output_parser(req, tok, prompt) if chat else None,
                       started_at=started, read_timeout=s.request_read_timeout,
                       keepalive_s=s.keepalive_s, metrics=gw.metrics,
                       one_call=chat and req.parallel_tool_calls is False,
                       resumer=Resumer(gw.cluster, m, backend.model, backend.model_path,
                                       timeout=s.resume_timeout, max_resumes=s.resume_max,
                                       metrics=gw.metrics, router=gw.router))
            for st, m in zip(streams, choices.choice_messages(msg, n), strict=True)]
    headers = {"x-lockstep-request-id": rid, "x-lockstep-deployment": backend.deployment_id}
    return Admitted(rid, backend, prompt, msg, streams, gens, started, endpoint, gw.metrics,
                    headers, router=gw.router)
