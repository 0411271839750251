"""The one request path under every API: a validated request (OpenAI chat or completion
form) → a serving deployment → tokens (chat template) → GENERATE to rank 0 → one
Generation per choice. Chat and text completions (openai_routes.py) and every API that
translates into the chat form use it, so tokenizing, tool parsers, grammar, logprobs,
sampling defaults, admission and the prefix cache are written once.

From `admit`'s return the streams are open on rank 0: the caller releases every one
exactly once (normal end, client disconnect, shutdown) — `Admitted.release_all`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from common.messages import Generate
from services.gateway import choices
from services.gateway.errors import ApiError
from services.gateway.generation import Final, Generation
from services.gateway.openai_schemas import ChatRequest
from services.gateway.prompts import Prompt, output_parser, prompt_ids, token_limit
from services.gateway.request_channel import Backend, RequestStream
from services.gateway.resume import Resumer
from services.gateway.sampling_params import generate_fields
from services.gateway.structured import grammar_for


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
    headers: dict[str, str] = field(default_factory=dict)

    def release_all(self, reason: str) -> None:
        for st in self.streams:
            st.release(reason)  # no-op for a stream already released

    def count(self, endpoint: str, metrics: Any, final: Final | None,
              outcome: str | None = None) -> None:
        metrics.requests.labels(endpoint=endpoint, model=self.backend.model,
                                outcome=outcome or outcome_of(final)).inc()


def outcome_of(final: Final | None) -> str:
    if final is None:
        return "unknown"
    if final.error is not None:
        return final.error.code or "error"
    return final.finish_reason


async def admit(request: Request, req: Any, *, chat: bool, rid_prefix: str,
                started: float | None = None, prompt_param: str | None = None) -> Admitted:
    """Pick, tokenize, check, send GENERATE (n choices): every refusal before rank 0 is an
    ApiError; `prompt_param` names the field a too-long or empty prompt is blamed on."""
    gw = request.app.state.gw
    started = time.monotonic() if started is None else started
    s = gw.settings
    param = prompt_param or ("messages" if chat else "prompt")
    backend = gw.pick(req.model)
    tok = await gw.tokenizer(backend)
    prompt = await gw.prepare_pool.run(prompt_ids, req, tok, s.input_bytes_per_token)
    ids = prompt.ids
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param, code="invalid_value")
    ctx = tok.context_len
    if ctx and len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {ctx}",
                       param=param, code="context_length_exceeded")
    limit = token_limit(req.limit(), s.default_max_tokens, ctx, len(ids))
    grammar = await gw.prepare_pool.run(grammar_for, req, tok) if chat else ""  # structured output
    rid = rid_prefix + secrets.token_hex(12)
    # The seed is drawn here when the client named none (not by rank 0): a request that
    # resumes elsewhere goes on with the same one (services/gateway/resume.py).
    msg = Generate(
        request_id=rid, prompt=ids, max_tokens=limit,
        seed=secrets.randbits(63) if req.seed is None else req.seed % (2**63),
        stop_token_ids=list(tok.eos_ids), client="gateway", grammar=grammar,
        **generate_fields(req, tok, backend.sampling, chat=chat))
    n = req.n or 1
    streams = await choices.open_streams(backend, msg, n)  # 503: retry-after
    gens = [Generation(st, tok, model=backend.model, stops=req.stops(),
                       parser=output_parser(req, tok, prompt) if chat else None,
                       started_at=started, read_timeout=s.request_read_timeout,
                       keepalive_s=s.keepalive_s, metrics=gw.metrics,
                       one_call=chat and isinstance(req, ChatRequest)
                       and req.parallel_tool_calls is False,
                       resumer=Resumer(gw.cluster, m, backend.model, backend.model_path,
                                       timeout=s.resume_timeout, max_resumes=s.resume_max,
                                       metrics=gw.metrics))
            for st, m in zip(streams, choices.choice_messages(msg, n), strict=True)]
    headers = {"x-lockstep-request-id": rid, "x-lockstep-deployment": backend.deployment_id}
    return Admitted(rid, backend, prompt, msg, streams, gens, started, headers)
