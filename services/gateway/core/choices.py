"""`n` > 1: n choices for one request, each its own request to rank 0, merged into one
response or one stream with choice indexes.

Choice i is request `<id>-i` with seed `seed + i`: the request's seed, or the one drawn
at its admission (so a request with a seed reproduces all n). Greedy choices are equal. The n requests share the prompt, so rank 0's prefix cache serves the later ones'
prefill. Admission counts all n: the bound is checked for n at once, before any is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from common.messages import Generate, Sampling
from common.request_params import SEED_MOD
from services.gateway.core.generation import Final, Generation
from services.gateway.core.request_channel import Backend, RequestStream
from services.gateway.core.streaming import DONE, Shape, collect, sse, sse_events


def choice_messages(msg: Generate, n: int) -> list[Generate]:
    if n == 1:
        return [msg]
    seed = msg.sampling.seed

    def sampling(i: int) -> Sampling:
        return dataclasses.replace(msg.sampling, seed=(seed + i) % SEED_MOD)

    return [dataclasses.replace(msg, request_id=f"{msg.request_id}-{i}", sampling=sampling(i))
            for i in range(n)]


async def open_streams(backend: Backend, msg: Generate, n: int,
                       cached: int = 0) -> list[RequestStream]:
    """GENERATE each choice; if one cannot be sent, the ones sent are aborted."""
    backend.check_room(n)
    streams: list[RequestStream] = []
    try:
        for m in choice_messages(msg, n):
            streams.append(await backend.generate(m, cached))
    except BaseException:
        for s in streams:
            s.release("client")
        raise
    return streams


def merged_final(finals: list[Final]) -> Final:
    """One Final for the whole response: the prompt counted once, completions summed,
    the first error (if any) and the earliest TTFTs."""
    first = finals[0]
    err = next((f.error for f in finals if f.error is not None), None)

    def earliest(vals):
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else None

    if len(finals) == 1:
        return first
    return dataclasses.replace(  # the prompt's fields (tokens, cached) from the first
        first, completion_tokens=sum(f.completion_tokens for f in finals),
        reasoning_tokens=sum(f.reasoning_tokens for f in finals),
        model_ttft_ms=earliest(f.model_ttft_ms for f in finals),
        visible_ttft_ms=earliest(f.visible_ttft_ms for f in finals), error=err,
        tool_calls=[], logprobs=[])


async def collect_all(gens: list[Generation], prefix: str) -> list[tuple[str, str, Final]]:
    """Every choice to its end: (text, reasoning, Final) each."""
    async def one(g: Generation) -> tuple[str, str, Final]:
        text, final = await collect(g, prefix)
        return text, "".join(g.reasoning), final

    if len(gens) == 1:
        return [await one(gens[0])]
    return list(await asyncio.gather(*(one(g) for g in gens)))


def body(shape: Shape, results: list[tuple[str, str, Final]]) -> dict:
    bodies = [shape.body(text, final, i, reasoning) for i, (text, reasoning, final) in
              enumerate(results)]
    out = bodies[0]
    if len(bodies) > 1:
        out["choices"] = [b["choices"][0] for b in bodies]
        merged = merged_final([f for _, _, f in results])
        out["usage"], out["lockstep"] = merged.usage(), merged.timings()
    return out


async def sse_choices(gens: list[Generation], shape: Shape, prefix: str,
                      on_end: Callable[[int, Final], None]) -> AsyncIterator[bytes]:
    """One SSE stream for all choices: their chunks as they come, each with its index;
    then (with include_usage) one usage chunk for all, then [DONE]. A choice that fails
    ends the whole stream with its error event (the caller releases the others)."""
    if len(gens) == 1:
        async for b in sse_events(gens[0], shape, prefix, lambda f: on_end(0, f)):
            yield b
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(gens))  # backpressure
    finals: dict[int, Final] = {}

    async def pump(i: int, g: Generation) -> None:
        def end(f: Final) -> None:
            finals[i] = f
            on_end(i, f)
        try:
            async for b in sse_events(g, shape, prefix, end, index=i, tail=False):
                await queue.put((i, b))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, b = await queue.get()
            if b is not None:
                yield b
                continue
            left -= 1
            f = finals.get(i)
            if f is None or f.error is not None:  # its error event went out: the end
                yield DONE
                return
        if shape.include_usage:
            yield sse(shape.usage_chunk(merged_final([finals[i] for i in range(len(gens))])))
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
