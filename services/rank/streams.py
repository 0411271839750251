"""Rank 0's ledger of open request streams: the one owner of "is this stream open".

Every GENERATE opens a stream here, in the I/O thread, before the main thread sees it,
and every chunk leaves through here: the main thread names a stream by request id
(`outbox.StreamChunk`), the ledger adds the connection and the index and builds the
`Tokens` — the one place a chunk, final or not, is built. So this thread knows exactly
what each client has received, and any thread can end every stream *now* — the
watchdog's abort stage, a hard exit — even while the main thread is stuck inside a
collective: `end_all` writes each stream's last chunk (`abort`, or `error` on the way
out) and marks it ended early. Whatever the main thread later sends for such a request
(tokens of the step that was in flight, its own final chunk after the removal plan) is
dropped, so a client never sees anything after the end; the main thread's own final
chunk closes the entry.

A GENERATE whose id is still open (a duplicate) or was ended early and is still in the
batch is answered here with an error and never reaches the main thread; so is one that
arrives while `max_open` streams are open (error_code overloaded, counted in `refused`):
rank 0's bound on what waits, whatever the number of gateways in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import ErrorCode, FinishReason, Generate, Tokens
from services.rank.outbox import StreamChunk


@dataclass
class _Open:
    ident: bytes
    prompt_tokens: int
    sent: int = 0  # tokens the client has received


def _tokens(c: StreamChunk, index: int, prompt_tokens: int) -> Tokens:
    return Tokens(request_id=c.request_id, tokens=c.tokens, index=index,
                  finish_reason=c.finish_reason, error=c.error, prompt_tokens=prompt_tokens,
                  model_ttft_ms=c.model_ttft_ms, step=c.step, token_times=c.token_times,
                  error_code=c.error_code, cached_tokens=c.cached_tokens,
                  logprobs=c.logprobs, top_ids=c.top_ids, top_logprobs=c.top_logprobs,
                  waiting=c.waiting)


class StreamLedger:
    def __init__(self, max_open: int = 0) -> None:
        self.open: dict[str, _Open] = {}
        self.ended_early: set[str] = set()
        self.dropped = 0  # chunks not sent because their stream had ended (or never was)
        self.max_open = max_open  # 0: no bound
        self.refused = 0  # GENERATEs refused as overloaded

    def on_generate(self, ident: bytes, g: Generate) -> Tokens | None:
        """Open the stream; or the error to answer at once (the request goes no further)."""
        rid = g.request_id
        if rid in self.ended_early:
            code, why = ErrorCode.DUPLICATE_REQUEST, \
                "that request_id was just cancelled and is still leaving the batch"
        elif rid in self.open:
            code, why = ErrorCode.DUPLICATE_REQUEST, \
                "duplicate request_id (that request is still active)"
        elif self.max_open and len(self.open) >= self.max_open:
            self.refused += 1
            code, why = ErrorCode.OVERLOADED, \
                f"rank 0 has {len(self.open)} open requests (its bound); retry later"
        else:
            self.open[rid] = _Open(ident, len(g.prompt))
            return None
        return _tokens(StreamChunk(rid, finish_reason=FinishReason.ERROR, error=why,
                                   error_code=code), 0, 0)

    def on_chunk(self, c: StreamChunk) -> tuple[bytes, Tokens] | None:
        """The main thread's chunk, addressed and indexed; None: it must not go out."""
        rid = c.request_id
        if rid in self.ended_early:
            self.dropped += 1
            if c.finish_reason is not None:
                self.ended_early.discard(rid)
            return None
        s = self.open.get(rid)
        if s is None:  # never opened here: no connection to send it on
            self.dropped += 1
            return None
        body = _tokens(c, s.sent, s.prompt_tokens)
        s.sent += len(c.tokens)
        if c.finish_reason is not None:
            del self.open[rid]
        return s.ident, body

    def end_all(self, finish_reason: FinishReason, error: str | None, code: ErrorCode | None,
                step: int = 0) -> list[tuple[bytes, Tokens]]:
        """Every open stream's last chunk; each stream counts as ended from now."""
        out = [(s.ident, _tokens(StreamChunk(rid, finish_reason=finish_reason, step=step,
                                             error=error, error_code=code),
                                 s.sent, s.prompt_tokens))
               for rid, s in self.open.items()]
        self.ended_early.update(self.open)
        self.open.clear()
        return out
