"""How a stream ends when its deployment fails (services/gateway/core/generation.py), on a
stand-in stream and tokenizer: with resume off, a failure code ends with the rank_lost
error (502 `backend_error`), never a bare `abort`; a client's cancel stays `abort`; and a
resume that raises (anything, a CancelledError included) still ends the stream with a
typed error instead of escaping."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common.messages import ErrorCode, FinishReason, Tokens
from services.gateway.core.generation import EndEvent, Finish, Generation
from services.gateway.core.resume import Resumer


class Detok:
    def add(self, tokens: list[int]) -> str:
        return "".join(f"t{t} " for t in tokens)

    def flush(self) -> str:
        return ""


class Stream:
    """Chunks as rank 0 sends them: two tokens, then the end given."""

    def __init__(self, end: Tokens) -> None:
        self.queue = [Tokens("r", [5, 6], 0), end]
        self.last_token_at = time.monotonic()
        self.request_id, self.prompt_len = "cmpl-test", 3
        self.abort_reason, self.refusal = None, None
        self.backend = SimpleNamespace(abort=lambda *a: None)

    async def next(self, timeout: float):
        self.last_token_at = time.monotonic()
        return self.queue.pop(0) if self.queue else None

    def ready(self) -> list:
        return []


def generation(end: Tokens, resumer=None) -> Generation:
    tok = SimpleNamespace(detokenizer=Detok)
    return Generation(Stream(end), tok, model="tiny", stops=[], parser=None, started_at=0.0,
                      read_timeout=60.0, keepalive_s=0.05, metrics=None, resumer=resumer)


def final(gen: Generation):
    async def go():
        return [e async for e in gen.events()]

    events = asyncio.run(go())
    ends = [e for e in events if isinstance(e, EndEvent)]
    assert len(ends) == 1, events
    return ends[0].final


def failed(code: ErrorCode) -> Tokens:
    return Tokens("r", [], 0, FinishReason.ABORT, error="peer lost: rank 1", error_code=code)


@pytest.mark.parametrize("code", [ErrorCode.WATCHDOG_ABORT, ErrorCode.RANK_LOST,
                                  ErrorCode.RANK_STOPPED, ErrorCode.DEPLOYMENT_FAILED])
def test_with_resume_off_a_failure_is_the_rank_lost_error(code):
    off = Resumer(SimpleNamespace(), SimpleNamespace(max_tokens=100), "tiny", None,
                  timeout=0.0, max_resumes=2)
    for resumer in (None, off):
        f = final(generation(failed(code), resumer))
        assert f.finish_reason is Finish.ERROR and f.completion_tokens == 2
        assert (f.error.status, f.error.code) == (502, "backend_error")
        assert "resume is off" in f.error.message


def test_a_cancel_stays_an_abort():
    f = final(generation(Tokens("r", [], 0, FinishReason.ABORT, error="client gone")))
    assert f.finish_reason is Finish.ABORT and f.error is None


@pytest.mark.parametrize("exc", [RuntimeError("boom"), asyncio.CancelledError()])
def test_a_resume_that_raises_still_ends_typed(exc):
    class Raising(Resumer):
        async def resume(self, s, produced, code):
            await asyncio.sleep(0.12)  # a keep-alive or two first
            raise exc

    r = Raising(SimpleNamespace(), SimpleNamespace(max_tokens=100), "tiny", None,
                timeout=60.0, max_resumes=2)
    f = final(generation(failed(ErrorCode.RANK_LOST), r))
    assert f.finish_reason is Finish.ERROR and f.error.status == 502
    assert f"the resume failed ({type(exc).__name__})" in f.error.message
