"""The canary (DESIGN.md 5.5): a real greedy generation of `canary_tokens` tokens through
rank 0's requests socket must succeed `canary_runs` times, spread over at least
`canary_window_s`, with identical tokens each time (greedy is deterministic; different
tokens mean the ranks disagree) before the deployment is `serving`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq.asyncio

from common.bus import Channel, new_request_id
from common.messages import REQUESTS_OUT, Abort, FinishReason, Generate
from common.rpc_client import AsyncRpcClient
from services.supervisor.deployment import Deployment
from services.supervisor.errors import LaunchError

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids below any real vocabulary size


async def _one(client: AsyncRpcClient, tokens: int, timeout: float) -> list[int]:
    rid = new_request_id()
    q = client.open_stream(rid)
    got: list[int] = []
    try:
        await client.send(Generate(request_id=rid, prompt=PROMPT, max_tokens=tokens,
                                   client="canary"))  # the default Sampling: greedy
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = await asyncio.wait_for(q.get(), max(0.01, left))
            except asyncio.TimeoutError:
                await client.send(Abort(request_id=rid, reason="canary timeout"))
                raise LaunchError(f"canary: {len(got)} of {tokens} tokens within "
                                  f"{timeout:.0f}s through rank 0") from None
            body = getattr(msg, "body", msg)  # a chunk out of a TOKENS_BATCH is bare
            if getattr(body, "tokens", None) is None:
                continue
            got += body.tokens
            if body.finish_reason is None:
                continue
            if body.error or body.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
                raise LaunchError(f"canary: rank 0 ended the generation with "
                                  f"{body.finish_reason}: {body.error or 'no error text'}")
            if not got or (body.finish_reason == FinishReason.LENGTH and len(got) != tokens):
                raise LaunchError(f"canary: got {len(got)} tokens, expected {tokens}")
            return got
    finally:
        client.close_stream(rid)


async def run_canary(dep: Deployment, ctx: zmq.asyncio.Context, sender: str, *, runs: int,
                     window_s: float, tokens: int, timeout: float,
                     aborted: Callable[[], str | None]) -> list[int]:
    channel = Channel("supervisor", "canary", sender=sender, send_key=dep.keys.requests,
                      accept=REQUESTS_OUT)
    client = AsyncRpcClient(ctx, dep.requests_endpoint, channel)
    gap = window_s / (runs - 1) if runs > 1 else 0.0
    first: list[int] | None = None
    try:
        for i in range(runs):
            started = time.monotonic()
            got = await _one(client, tokens, timeout)
            if first is None:
                first = got
            elif got != first:
                raise LaunchError(f"canary run {i + 1} gave tokens {got}, run 1 gave {first}: "
                                  "greedy output differs between runs")
            if (why := aborted()) is not None:
                raise LaunchError(f"launch aborted: {why}")
            if i + 1 < runs:
                await asyncio.sleep(max(0.0, gap - (time.monotonic() - started)))
        return first or []
    finally:
        client.close()
