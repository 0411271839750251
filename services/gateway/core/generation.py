"""From token chunks to what the client sees: detokenize → stop strings → tool calls.

`Generation.events()` yields, in order, `TextEvent`, `ReasoningEvent` (chat: the
model's reasoning, output_parser.py), `ToolCallEvent`, `LogprobsEvent` before the text of
those tokens (only if the request asked), `KEEPALIVE` while rank 0 is quiet, and finally
one `EndEvent` carrying the Final. It never raises for an outcome of the request itself:
a read timeout or a rank error ends as a Final carrying an ApiError, an abort as
`Finish.ABORT`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.messages import ErrorCode, FinishReason
from services.gateway.core.detok import ModelTokenizer
from services.gateway.core.errors import ApiError
from services.gateway.core.logprobs import TokenLogprob, from_body
from services.gateway.core.metrics import Metrics
from services.gateway.core.output_parser import OutputParser, State
from services.gateway.core.reasoning_count import for_format
from services.gateway.core.request_channel import RequestStream
from services.gateway.core.resume import RESUMABLE, Outcome, Result, Resumer
from services.gateway.core.stops import StopMatcher
from services.gateway.core.toolcalls import ToolCall

log = logging.getLogger("lockstep.gateway.generation")


class Finish(str, enum.Enum):
    """How a reply ended, as the APIs say it (OpenAI's `finish_reason`; the Messages and
    Responses renderers map it on): rank 0's FinishReason one for one, and TOOL_CALLS, a
    stop whose output was tool calls — the gateway's rendering, never a wire value."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, reason: FinishReason) -> Finish:
        return cls(reason)  # by value: the members are one for one


@dataclass
class Final:
    finish_reason: Finish
    prompt_tokens: int
    completion_tokens: int
    model_ttft_ms: float | None = None
    visible_ttft_ms: float | None = None
    error: ApiError | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    abort_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # asked for: every token's
    cached_tokens: int = 0  # of the prompt, served from rank 0's prefix cache
    reasoning_tokens: int = 0  # of the completion, inside the reasoning block

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},  # OpenAI's
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}

    def timings(self) -> dict:
        return {"ttft_model_ms": _ms(self.model_ttft_ms), "ttft_visible_ms": _ms(self.visible_ttft_ms)}


@dataclass(frozen=True, slots=True)
class TextEvent:
    text: str  # what the client sees as content (or a completion's text)


@dataclass(frozen=True, slots=True)
class ReasoningEvent:
    text: str  # inside the model's reasoning block


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class LogprobsEvent:
    entries: list[TokenLogprob]  # of tokens whose text follows


@dataclass(frozen=True, slots=True)
class KeepaliveEvent:
    """Rank 0 is quiet: the consumer may send a keep-alive."""


KEEPALIVE = KeepaliveEvent()


@dataclass(frozen=True, slots=True)
class EndEvent:
    final: Final  # the last event of every generation


Event = TextEvent | ReasoningEvent | ToolCallEvent | LogprobsEvent | KeepaliveEvent | EndEvent


@dataclass(frozen=True)
class RankErrorShape:
    """What the client sees for one rank error code: HTTP status, OpenAI error code and
    type, and the sentence that leads the rank's own text."""

    status: int
    code: str
    lead: str
    type_: str | None = None  # None: the status's type (errors.TYPES)


# Every rank error code → what the client sees: the one table. Codes are the client's to
# fix (400), a deployment that is not serving (503), a bound (429; the stream's refusal
# carries retry-after), or a failure in the engine (502).
RANK_ERRORS: dict[ErrorCode, RankErrorShape] = {
    ErrorCode.INVALID_REQUEST: RankErrorShape(400, "invalid_request", "rank 0 refused the request: "),
    ErrorCode.PROMPT_TOO_LONG: RankErrorShape(400, "invalid_request", "rank 0 refused the request: "),
    ErrorCode.KV_BUDGET: RankErrorShape(400, "kv_budget_exceeded", "rank 0 refused the request: "),
    ErrorCode.DUPLICATE_REQUEST: RankErrorShape(400, "invalid_request", "rank 0 refused the request: "),
    ErrorCode.NOT_SERVING: RankErrorShape(503, "model_not_ready", "rank 0 is "),
    ErrorCode.OVERLOADED: RankErrorShape(429, "overloaded", "rank 0 is at its bound: "),
    ErrorCode.RANK_STOPPED: RankErrorShape(502, "backend_error", "generation failed on rank 0: "),
    ErrorCode.WATCHDOG_ABORT: RankErrorShape(502, "backend_error", "generation failed on rank 0: "),
    ErrorCode.RANK_LOST: RankErrorShape(502, "backend_error", "generation failed on rank 0: "),
    ErrorCode.DEPLOYMENT_FAILED: RankErrorShape(502, "backend_error",
                                                "generation failed on rank 0: "),
}
# A chunk that ended in error with no code (a rank that predates the code) is an engine
# failure, as any error without a cause.
NO_CODE = RankErrorShape(502, "backend_error", "generation failed on rank 0: ")
if set(RANK_ERRORS) != set(ErrorCode):  # a new member must get its row here, at import
    raise RuntimeError(f"RANK_ERRORS lacks {set(ErrorCode) - set(RANK_ERRORS)}")


def rank_error(code: ErrorCode | None, text: str | None) -> ApiError:
    shape = NO_CODE if code is None else RANK_ERRORS[code]
    return ApiError(shape.status, shape.lead + (text or "unknown error"), code=shape.code,
                    type_=shape.type_)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


class Generation:
    def __init__(self, stream: RequestStream, tok: ModelTokenizer, *, model: str,
                 stops: list[str], parser: OutputParser | None, started_at: float,
                 read_timeout: float, keepalive_s: float, metrics: Metrics | None,
                 one_call: bool = False, resumer: Resumer | None = None) -> None:
        self.stream = stream
        self.resumer = resumer  # None: a failed deployment ends the request (rank_lost)
        self.token_ids: list[int] = []  # every token received: a continuation's context
        self.model = model
        self.tok = tok
        self.detok = tok.detokenizer()
        self.logprobs: list[TokenLogprob] = []  # every token's, when the request asked
        self.stops = StopMatcher(stops)
        self.tools = parser  # content / reasoning / tool calls (chat); None: raw text
        self.thinking = None if parser is None else for_format(
            parser.fmt, parser.state is State.REASONING)  # counts reasoning tokens
        self.one_call = one_call  # parallel_tool_calls false: the first call only
        self.calls: list[ToolCall] = []
        self.reasoning: list[str] = []  # the reasoning text so far (non-streaming bodies)
        self.started_at = started_at  # monotonic, when the HTTP request arrived
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self.metrics = metrics
        self.completion_tokens = 0
        self.cached_tokens = 0  # rank 0 says so on the request's first chunk
        self.cached_attempt = 0  # the continuation they come from (0: the first attempt)
        self.model_ttft_ms: float | None = None
        self.visible_at: float | None = None
        self._last_token_time: float | None = None
        # The labelled child once: `labels()` per chunk is a lock and a dict lookup.
        self._token_latency = None if metrics is None else metrics.token_latency.labels(model=model)

    def mark_visible(self) -> None:
        """The consumer is about to send the first visible byte."""
        if self.visible_at is None:
            self.visible_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.ttft_visible.labels(model=self.model).observe(self.visible_at - self.started_at)

    def _text_events(self, text: str, final: bool = False) -> list[Event]:
        out = self.stops.feed(text)
        if final:
            out += self.stops.flush()
        return self._parsed(out, final)

    def _stop_cut(self, tokens: list[int], lps: list[TokenLogprob]
                  ) -> tuple[str, list[int], list[TokenLogprob]]:
        """The text `tokens` add once stop strings are applied, and the tokens (and their
        logprobs) that are output: with stop strings, up to the one whose text completed
        a stop — never the ones rank 0 happened to send in the same chunk after it, so
        what a client gets does not depend on the chunking (a resumed request's
        differs from an unfaulted run's)."""
        if not self.stops.stops:
            return self.detok.add(tokens), tokens, lps
        out = []
        for i, t in enumerate(tokens):
            out.append(self.stops.feed(self.detok.add([t])))
            if self.stops.stopped:
                return "".join(out), tokens[:i + 1], lps[:i + 1]
        return "".join(out), tokens, lps

    def _parsed(self, out: str, final: bool = False) -> list[Event]:
        if self.tools is None:
            return [TextEvent(out)] if out else []
        parsed = self.tools.feed(out) if out else []
        if final:
            parsed += self.tools.flush()
        kept: list[Event] = []
        for k, v in parsed:
            if k == "tool_call":
                if self.one_call and self.calls:
                    continue
                self.calls.append(v)  # type: ignore[arg-type]
                kept.append(ToolCallEvent(v))  # type: ignore[arg-type]
            elif k == "reasoning":
                self.reasoning.append(v)  # type: ignore[arg-type]
                kept.append(ReasoningEvent(v))  # type: ignore[arg-type]
            else:
                kept.append(TextEvent(v))  # type: ignore[arg-type]
        return kept

    def _observe_tokens(self, times: list[float]) -> None:
        h = self._token_latency
        if h is None or not times:
            return
        prev = self._last_token_time
        for t in times:
            if prev is not None and t >= prev:
                h.observe(t - prev)
            prev = t
        self._last_token_time = prev

    async def events(self) -> AsyncIterator[Event]:
        s = self.stream
        error: ApiError | None = None
        finish = Finish.STOP
        while True:
            quiet = time.monotonic() - s.last_token_at
            left = self.read_timeout - quiet
            if left <= 0:
                s.backend.abort(s, "read_timeout")
                error = ApiError(504, f"no token from the model for {self.read_timeout:g}s; "
                                 "the request was cancelled", code="read_timeout")
                finish = Finish.ABORT
                break
            first = await s.next(min(self.keepalive_s, left))
            if first is None:
                yield KEEPALIVE
                continue
            bodies = [first, *s.ready()]  # behind? coalesce what is queued into one delta
            body = bodies[-1]
            tokens: list[int] = []
            lps: list[TokenLogprob] = []
            first_attempt = self.resumer is None or not self.resumer.resumes
            # usage's cached tokens are those of the attempt that prefilled the client's
            # prompt: the one its first token came from (a continuation after output
            # prefilled prompt + output, not the prompt)
            serves_prompt = not self.token_ids
            if serves_prompt and not first_attempt and self.cached_attempt != self.resumer.attempts:
                self.cached_attempt, self.cached_tokens = self.resumer.attempts, 0
            for b in bodies:
                if self.model_ttft_ms is None and b.model_ttft_ms is not None:
                    self.model_ttft_ms = b.model_ttft_ms
                    if self.metrics is not None:
                        self.metrics.ttft_model.labels(model=self.model).observe(b.model_ttft_ms / 1000)
                if serves_prompt:
                    self.cached_tokens = max(self.cached_tokens, b.cached_tokens)
                tokens += b.tokens
                if b.logprobs:
                    lps += from_body(self.tok, b)
                self._observe_tokens(b.token_times)
            text, tokens, lps = self._stop_cut(tokens, lps) if tokens else ("", tokens, lps)
            if lps:  # before the text of the same tokens
                self.logprobs += lps
                yield LogprobsEvent(lps)
            if tokens:
                self.completion_tokens += len(tokens)
                self.token_ids += tokens
                if self.thinking is not None:
                    self.thinking.feed(tokens)
                if not first_attempt:
                    self.resumer.first_token()
                for ev in self._parsed(text):
                    yield ev
                if self.stops.stopped:
                    if not body.finish_reason:
                        s.backend.abort(s, "stop_string")
                    finish = Finish.STOP
                    # The text ends here: what the tool-call parser holds back (a
                    # possible "<tool_call>" start, an unclosed envelope) is text.
                    for ev in self._text_events("", final=True):
                        yield ev
                    break
            if body.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) \
                    and self.resumer is not None \
                    and self.resumer.wants(body.error_code):
                if self.resumer.remaining(len(self.token_ids)) <= 0:
                    finish = Finish.LENGTH  # nothing left to generate: as an unfaulted run ends
                    for ev in self._text_events(self.detok.flush(), final=True):
                        yield ev
                    break
                # Wait for a serving deployment (keep-alives meanwhile), then go on there.
                task = asyncio.ensure_future(
                    self.resumer.resume(s, self.token_ids, body.error_code))
                try:
                    while not task.done():
                        await asyncio.wait({task}, timeout=self.keepalive_s)
                        if not task.done():
                            yield KEEPALIVE
                finally:
                    if not task.done():
                        task.cancel()
                try:
                    result = task.result()
                except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - any
                    # failure of the resume itself still ends the stream typed, with [DONE]
                    log.error("request %s: its resume failed: %s: %s", s.request_id,
                              type(exc).__name__, exc, exc_info=exc)
                    result = Result(Outcome.GAVE_UP, f"the resume failed ({type(exc).__name__})")
                if result.outcome is Outcome.RESUMED:
                    continue
                if result.outcome is Outcome.CANCELLED:
                    finish = Finish.ABORT
                else:
                    finish = Finish.ERROR
                    error = rank_error(body.error_code, f"{body.error}; not resumed: {result.why}")
                for ev in self._text_events(self.detok.flush(), final=True):
                    yield ev
                break
            if body.finish_reason:
                finish = Finish.of(body.finish_reason)
                if finish is Finish.ABORT and body.error_code in RESUMABLE:
                    # a failure (a watchdog abort, a lost rank), not a cancel: with resume
                    # off (or none) it is the rank_lost error, never a bare `abort`
                    finish = Finish.ERROR
                    error = rank_error(body.error_code, f"{body.error}; not resumed: resume "
                                       "is off (LOCKSTEP_RESUME_TIMEOUT=0)")
                elif finish is Finish.ERROR:
                    error = s.refusal or rank_error(body.error_code, body.error)
                for ev in self._text_events(self.detok.flush(), final=True):
                    yield ev
                break
        if self.calls and finish is Finish.STOP:
            finish = Finish.TOOL_CALLS
        if self.metrics is not None:
            self.metrics.tokens.labels(model=self.model, kind="completion").inc(self.completion_tokens)
            self.metrics.tokens.labels(model=self.model, kind="prompt").inc(s.prompt_len)
            if self.model_ttft_ms is not None:  # rank 0 prefilled it: a hit or a miss
                self.metrics.prefix_cache(self.model, self.cached_tokens)
        visible = None if self.visible_at is None else (self.visible_at - self.started_at) * 1000
        yield EndEvent(Final(finish, s.prompt_len, self.completion_tokens, self.model_ttft_ms,
                             visible, error, list(self.calls),
                             s.abort_reason, self.logprobs, self.cached_tokens,
                             0 if self.thinking is None else self.thinking.count))
