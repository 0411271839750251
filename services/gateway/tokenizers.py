"""Each model's tokenizer, loaded once as soon as a serving deployment names it.

Loading takes ~1 s (transformers import, tokenizer files, the byte table); done by the
first request, it added that to its TTFT, and done by several first requests at once
it raced through transformers' lazy import. Here the cluster asks for it when it learns
of a deployment (`want`), one worker thread loads it, `/ready` stays false for that
deployment until it is `loaded`, and requests that come earlier wait for the same load.
A failed load is retried after RETRY_S, when the cluster next asks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services.gateway.detok import ModelTokenizer, load_tokenizer
from services.gateway.errors import ApiError

log = logging.getLogger("lockstep.gateway.tokenizers")
RETRY_S = 10.0


@dataclass
class _Load:
    task: asyncio.Task
    tok: ModelTokenizer | None = None
    error: str | None = None
    failed_at: float | None = None


class Tokenizers:
    def __init__(self) -> None:
        self._loads: dict[str, _Load] = {}

    def want(self, path: str) -> None:
        """Start loading `path` unless it is loaded, loading, or failed less than RETRY_S ago."""
        cur = self._loads.get(path)
        if cur is not None and (cur.failed_at is None or time.monotonic() - cur.failed_at < RETRY_S):
            return
        task = asyncio.get_running_loop().create_task(self._load(path))
        self._loads[path] = _Load(task)

    async def _load(self, path: str) -> None:
        t0 = time.monotonic()
        try:
            tok = await asyncio.to_thread(load_tokenizer, path)
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises
            ld = self._loads[path]
            ld.error, ld.failed_at = f"{type(exc).__name__}: {exc}", time.monotonic()
            log.warning("cannot load the tokenizer of %s: %s", path, ld.error)
            return
        self._loads[path].tok = tok
        log.info("tokenizer of %s loaded in %.2fs", path, time.monotonic() - t0)

    def state(self, path: str | None) -> str:
        """"loaded", "loading", "failed: why" or "none" (never asked for)."""
        ld = self._loads.get(path) if path else None
        if ld is None:
            return "none"
        if ld.tok is not None:
            return "loaded"
        return f"failed: {ld.error}" if ld.error is not None else "loading"

    async def get(self, path: str | None, deployment_id: str) -> ModelTokenizer:
        """The tokenizer, waiting for a load in progress; 503 if there is none."""
        if not path:
            raise ApiError(503, f"deployment {deployment_id} names no model path", code="no_tokenizer")
        self.want(path)
        ld = self._loads[path]
        if ld.tok is None and ld.error is None:
            await asyncio.shield(ld.task)  # one load, however many requests wait on it
        if ld.tok is None:
            raise ApiError(503, f"cannot load the tokenizer of {path}: {ld.error}",
                           code="no_tokenizer", headers={"retry-after": str(int(RETRY_S))})
        return ld.tok

    def close(self) -> None:
        for ld in self._loads.values():
            ld.task.cancel()
