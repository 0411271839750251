"""Each model's tokenizer, loaded once as soon as a serving deployment names it.

Loading takes ~1 s (transformers import, tokenizer files, the byte table); done by the
first request, it added that to its TTFT, and done by several first requests at once
it raced through transformers' lazy import. Here the cluster asks for it when it learns
of a deployment (`want`), one worker thread loads it, `/ready` stays false for that
deployment until it is `loaded`, and requests that come earlier wait for the same load.
A failed load is retried after RETRY_S, when the cluster next asks.

The same thread then renders the chat template once (`warm`): transformers compiles a
template's jinja on its first render (~15 ms here, more on a loaded host), which the
first chat request paid. A model without a chat template is warmed by an encode alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services.gateway.core.detok import ChatTemplateError, ModelTokenizer, load_tokenizer
from services.gateway.core.errors import ApiError

log = logging.getLogger("lockstep.gateway.tokenizers")
RETRY_S = 10.0
WARM_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Warmed:
    """What `warm` did for one tokenizer before it counted as loaded."""

    chat_template: bool  # rendered (False: the model has none)
    prompt_tokens: int
    seconds: float


def warm(tok: ModelTokenizer) -> Warmed:
    """Render the chat template, encode and detokenize once, as a first request would."""
    t0 = time.monotonic()
    try:
        ids = tok.chat_prompt(WARM_MESSAGES, None)
        templated = True
    except ChatTemplateError:
        ids, templated = tok.encode(WARM_MESSAGES[0]["content"]), False
    tok.detokenizer().add(ids)
    return Warmed(templated, len(ids), time.monotonic() - t0)


@dataclass
class _Load:
    task: asyncio.Task
    tok: ModelTokenizer | None = None
    warmed: Warmed | None = None
    error: str | None = None
    failed_at: float | None = None


def _load_warm(path: str) -> tuple[ModelTokenizer, Warmed]:
    tok = load_tokenizer(path)
    try:
        return tok, warm(tok)
    except Exception as exc:  # noqa: BLE001 - a warm-up must not make a usable tokenizer fail
        log.warning("tokenizer of %s: warming it failed (%s); the first request does it", path, exc)
        return tok, Warmed(False, 0, 0.0)


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
            tok, warmed = await asyncio.to_thread(_load_warm, path)
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises
            ld = self._loads[path]
            ld.error, ld.failed_at = f"{type(exc).__name__}: {exc}", time.monotonic()
            log.warning("cannot load the tokenizer of %s: %s", path, ld.error)
            return
        ld = self._loads[path]
        ld.tok, ld.warmed = tok, warmed  # "loaded" from here on: /ready may say so
        log.info("tokenizer of %s loaded in %.2fs; %s in %.0f ms (%d tokens)", path,
                 time.monotonic() - t0,
                 "chat template rendered" if warmed.chat_template else "no chat template: encoded",
                 warmed.seconds * 1000, warmed.prompt_tokens)

    def warmed(self, path: str) -> Warmed | None:
        ld = self._loads.get(path)
        return None if ld is None else ld.warmed

    def loaded(self, path: str | None) -> bool:
        ld = self._loads.get(path) if path else None
        return ld is not None and ld.tok is not None

    def state(self, path: str | None) -> str:
        """For people (/ready): "loaded", "loading", "failed: why" or "none" (never asked
        for); code asks `loaded`."""
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
