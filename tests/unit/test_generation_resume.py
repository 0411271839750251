"""A resumed request reads as an unfaulted one (services/gateway/core/generation.py): with the
embedded model's real tokenizer (a thinking variant with its tool-call parser), the same
tokens are delivered once straight and once cut by a deployment failure after every k
of them, the rest coming from a continuation; every k must give the client exactly the
unfaulted run's events: text, reasoning, tool calls, stop-string cut, logprobs, usage.

Covers the resume branches: nothing streamed yet (k=0), a `<think>` block, a tool-call
envelope and a stop string split by the failure, logprobs across it, nothing left to
generate (max_tokens reached at the failure: no resume, `length`), and usage's cached
tokens taken from the attempt that prefilled the client's prompt.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common.messages import ErrorCode, FinishReason, Generate, Tokens
from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.generation import (
    KEEPALIVE,
    EndEvent,
    Finish,
    Generation,
    LogprobsEvent,
    ReasoningEvent,
    TextEvent,
    ToolCallEvent,
)
from services.gateway.core.output_parser import OutputParser
from services.gateway.core.resume import Outcome, Result, Resumer
from tests.support.thinker_model import thinker_model

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
CHAT = ('<think>the user wants a sum; call add</think>Sure, adding. <tool_call>\n'
        '{"name": "add", "arguments": {"a": 41}}\n</tool_call>')
TEXT = "one two three, and then the end comes here and more text after it"
STOP = "the end"
CHUNK = 3  # tokens per chunk, as rank 0 coalesces them
FIRST_CACHED, CONT_CACHED = 5, 9  # what each attempt's first chunk says it had cached


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tiny = build_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")
    t = load_tokenizer(thinker_model(tiny, tmp_path_factory.mktemp("t") / "thinker"))
    assert t.fmt.has_thinking and t.fmt.has_tools
    return t


def chunks(tokens: list[int], start: int, cached: int) -> list[Tokens]:
    """`tokens` (the completion from index `start`) as rank 0's chunks, with logprobs."""
    out = []
    for i in range(0, len(tokens), CHUNK):
        part = tokens[i:i + CHUNK]
        idx = [start + i + j for j in range(len(part))]
        out.append(Tokens("r", part, start + i, cached_tokens=cached if i == 0 else 0,
                          logprobs=[-0.01 * (n + 1) for n in idx],
                          top_ids=[[t, t + 1] for t in part],
                          top_logprobs=[[-0.01 * (n + 1), -3.0] for n in idx]))
    return out


class Stream:
    """A request's stream as Generation reads it: chunks queued in order."""

    def __init__(self, items: list[Tokens]) -> None:
        self.items = list(items)
        self.last_token_at = time.monotonic()
        self.request_id, self.prompt_len = "cmpl-test", 4
        self.abort_reason, self.refusal = None, None
        self.aborted: list[str] = []
        self.backend = SimpleNamespace(abort=lambda s, why: self.aborted.append(why))

    async def next(self, timeout: float):
        self.last_token_at = time.monotonic()
        return self.items.pop(0) if self.items else None

    def ready(self) -> list:
        return []


class Continuation(Resumer):
    """The resume: checks the continuation's context is exactly what was streamed, then
    queues what the new rank 0 sends (the remaining tokens, its own cached count)."""

    def __init__(self, rest: list[int], max_tokens: int) -> None:
        super().__init__(SimpleNamespace(), Generate(request_id="r", prompt=[1, 2, 3, 4],
                                                     max_tokens=max_tokens, client="t"),
                         "tiny", None, timeout=60.0, max_resumes=2)
        self.rest, self.called_with = rest, None

    async def resume(self, s, produced, code):
        self.called_with = list(produced)
        self.resumes += 1
        self.attempts += 1
        s.items += chunks(self.rest, len(produced), CONT_CACHED)
        s.items.append(Tokens("r", [], 0, FinishReason.STOP))
        return Result(Outcome.RESUMED)


def run(tok, tokens: list[int], *, cut: int | None, chat: bool, max_tokens: int = 1000,
        finish: FinishReason = FinishReason.STOP):
    """What the client sees for `tokens`, straight (cut None) or failed after `cut`."""
    head = tokens if cut is None else tokens[:cut]
    items = chunks(head, 0, FIRST_CACHED)
    if cut is None:
        items.append(Tokens("r", [], 0, finish))
        resumer = None
    else:
        items.append(Tokens("r", [], 0, FinishReason.ABORT, error="peer lost: rank 1",
                            error_code=ErrorCode.WATCHDOG_ABORT))
        resumer = Continuation(tokens[cut:], max_tokens)
    parser = OutputParser(tok.fmt, tools=TOOLS, tool_names={"add"}) if chat else None
    gen = Generation(Stream(items), tok, model="tiny", stops=[] if chat else [STOP],
                     parser=parser, started_at=0.0, read_timeout=60.0, keepalive_s=0.05,
                     metrics=None, resumer=resumer)

    async def go():
        return [e async for e in gen.events() if e is not KEEPALIVE]

    events = asyncio.run(go())
    assert isinstance(events[-1], EndEvent)
    return seen(events), events[-1].final, resumer


def seen(events) -> dict:
    """The client's view: text runs merged (their chunking is the transport's)."""
    out = {"text": "", "reasoning": "", "calls": [], "logprobs": []}
    for e in events:
        if isinstance(e, TextEvent):
            out["text"] += e.text
        elif isinstance(e, ReasoningEvent):
            out["reasoning"] += e.text
        elif isinstance(e, ToolCallEvent):
            out["calls"].append((e.call.name, e.call.arguments))
        elif isinstance(e, LogprobsEvent):
            out["logprobs"] += [(x.token, x.logprob, [(a.token, a.logprob) for a in x.top])
                                for x in e.entries]
    return out


def summary(final) -> tuple:
    return (final.finish_reason, final.completion_tokens, final.prompt_tokens,
            final.error, final.reasoning_tokens, [(c.name, c.arguments) for c in final.tool_calls])


@pytest.mark.parametrize("chat", [True, False], ids=["think+tool_call", "stop_string"])
def test_a_failure_after_any_token_reads_as_the_unfaulted_run(tok, chat):
    tokens = tok.encode(CHAT if chat else TEXT)
    want, want_final, _ = run(tok, tokens, cut=None, chat=chat)
    if chat:  # the straight run is what the cases are about
        assert want["reasoning"] and want["calls"] == [("add", '{"a": 41}')]
        assert want_final.finish_reason is Finish.TOOL_CALLS
    else:
        assert want["text"] == TEXT[:TEXT.index(STOP)]
    out = want_final.completion_tokens  # with a stop string: up to the token completing it
    assert out == (len(tokens) if chat else len(want["logprobs"])) and out <= len(tokens)
    for cut in range(len(tokens)):
        got, final, resumer = run(tok, tokens, cut=cut, chat=chat)
        # resumed with exactly what was streamed — unless the stop came before the failure
        assert resumer.called_with == (tokens[:cut] if cut < out else None), cut
        assert got == want, cut
        assert summary(final) == summary(want_final), cut
        # the prompt's cached tokens: from the attempt that prefilled it
        assert final.cached_tokens == (CONT_CACHED if cut == 0 else FIRST_CACHED), cut


def test_nothing_left_to_generate_at_the_failure_ends_as_length(tok):
    tokens = tok.encode(TEXT)[:7]
    want, want_final, _ = run(tok, tokens, cut=None, chat=False, finish=FinishReason.LENGTH)
    got, final, resumer = run(tok, tokens + [99], cut=7, chat=False, max_tokens=7)
    assert resumer.called_with is None  # no continuation was asked for
    assert got == want and summary(final) == summary(want_final)
    assert final.finish_reason is Finish.LENGTH
