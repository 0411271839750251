"""Rank 0's I/O-side ledger of open request streams.

Every GENERATE opens a stream and every TOKENS leaves through the I/O thread, so this
thread knows exactly what each client has received. That lets any thread end every
stream *now* — the watchdog's abort stage, a hard exit — even while the main thread is
stuck inside a collective: `end_all` writes each stream's last chunk (`abort`, or
`error` on the way out) and marks it ended early. Whatever the main thread later sends
for such a request (tokens of the step that was in flight, its own final chunk after
the removal plan) is dropped, so a client never sees anything after the end; the main
thread's own final chunk closes the entry.

A GENERATE whose id is still open (a duplicate) or was ended early and is still in the
batch is answered here with an error and never reaches the main thread; so is one that
arrives while `max_open` streams are open (error_code overloaded, counted in `refused`):
rank 0's bound on what waits, whatever the number of gateways in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import ErrorCode, Generate, Tokens


@dataclass
class _Open:
    ident: bytes
    prompt_tokens: int
    sent: int = 0  # tokens the client has received


class StreamLedger:
    def __init__(self, max_open: int = 0) -> None:
        self.open: dict[str, _Open] = {}
        self.ended_early: set[str] = set()
        self.dropped = 0  # chunks not sent because their stream had ended
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
        return Tokens(request_id=rid, tokens=[], index=0, finish_reason="error", error=why,
                      error_code=code)

    def on_send(self, body: object) -> bool:
        """Whether the main thread's chunk may go out."""
        if not isinstance(body, Tokens):
            return True
        rid = body.request_id
        if rid in self.ended_early:
            self.dropped += 1
            if body.finish_reason is not None:
                self.ended_early.discard(rid)
            return False
        s = self.open.get(rid)
        if s is not None:
            s.sent = body.index + len(body.tokens)
            if body.finish_reason is not None:
                del self.open[rid]
        return True

    def end_all(self, finish_reason: str, error: str | None,
                code: ErrorCode) -> list[tuple[bytes, Tokens]]:
        """Every open stream's last chunk; each stream counts as ended from now."""
        out = []
        for rid, s in self.open.items():
            out.append((s.ident, Tokens(request_id=rid, tokens=[], index=s.sent,
                                        finish_reason=finish_reason, error=error,
                                        prompt_tokens=s.prompt_tokens, error_code=code)))
            self.ended_early.add(rid)
        self.open.clear()
        return out
