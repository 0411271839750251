"""Background responses (`background: true`): the request returns at once with the
response `in_progress`; its generation goes on in the gateway, on the same admitted
streams (the same admission bound counts it), and its final form replaces the stored
one when it ends. `GET /v1/responses/{id}` shows the output so far while it runs.

`POST /v1/responses/{id}/cancel` aborts it as a client disconnect does: an ABORT to
rank 0, which removes it from the batch at its next step boundary on every rank (the
plan carries the removal); the response ends `cancelled` with the output generated until
then. A background response needs the store (`store: false` → 400) and is not streamed
(`stream: true` → 400): it outlives its request, so only GET can show it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.core.generation import Final, Finish
from services.gateway.core.request_path import Admitted
from services.gateway.responses.store import ResponseStore, output_as_input
from services.gateway.responses.stream import Envelope, Output, collect, error_of, status_of

CANCEL_WAIT_S = 30.0  # for the final chunk after the ABORT (rank 0 answers within a step)


@dataclass
class Running:
    run: Admitted
    out: Output
    env: Envelope
    conversation: list[dict[str, Any]]
    task: asyncio.Future | None = None
    cancelled: bool = False
    body: dict[str, Any] | None = field(default=None)  # the final response, once ended


class Background:
    """The background responses still generating, by id."""

    def __init__(self) -> None:
        self.running: dict[str, Running] = {}

    def start(self, run: Admitted, out: Output, env: Envelope, conversation: list[dict],
              store: ResponseStore, count: Callable[[Final | None], None]) -> dict:
        r = Running(run, out, env, conversation)
        self.running[run.rid] = r
        snapshot = env.body("in_progress", [])
        store.put(run.rid, snapshot, conversation)
        r.task = asyncio.ensure_future(self._run(r, store, count))
        return snapshot

    async def _run(self, r: Running, store: ResponseStore,
                   count: Callable[[Final | None], None]) -> None:
        final: Final | None = None
        try:
            final = await collect(r.run.gens[0], r.out)
        finally:
            r.run.release_all("shutdown")  # no-op after a normal end
            self.running.pop(r.run.rid, None)
            count(final)
        cancelled = r.cancelled and final.finish_reason == Finish.ABORT and final.error is None
        r.body = r.env.body("cancelled" if cancelled else status_of(final), r.out.items, final,
                            None if cancelled else error_of(final))
        store.put(r.run.rid, r.body, r.conversation + output_as_input(r.out.items))

    def snapshot(self, rid: str) -> dict | None:
        r = self.running.get(rid)
        return None if r is None else r.env.body("in_progress", r.out.items)

    async def cancel(self, rid: str) -> dict | None:
        """Abort a running one and wait for its end: its final response (None: not
        running here)."""
        r = self.running.get(rid)
        if r is None or r.task is None:
            return None
        r.cancelled = True
        st = r.run.streams[0]
        st.backend.abort(st, "cancel")  # the generation reads on to rank 0's final chunk
        await asyncio.wait_for(asyncio.shield(r.task), CANCEL_WAIT_S)
        return r.body
