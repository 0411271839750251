"""reasoning_tokens counts the tokens strictly inside the reasoning block, on token ids:
one-token and several-token markers, a block the prompt opened, tokens in any chunking."""

from __future__ import annotations

from services.gateway.core.chat_format import ChatFormat
from services.gateway.core.reasoning_count import ReasoningCounter, for_format

START, END = 5, 6


def counted(tokens: list[int], chunks: int, **kw) -> int:
    c = ReasoningCounter(kw.pop("start", (START,)), kw.pop("end", (END,)), **kw)
    for i in range(0, len(tokens), chunks):
        c.feed(tokens[i:i + chunks])
    return c.count


def test_one_token_markers_any_chunking():
    toks = [1, START, 2, 3, 4, END, 7, 8]
    for n in (1, 2, 3, len(toks)):
        assert counted(toks, n) == 3
    assert counted([2, 3, END, 7], 1, in_reasoning=True) == 2  # the template opened it
    assert counted([1, 2, 3], 1) == 0
    assert counted([START, 2, 3], 1) == 2  # cut off inside: what was generated counts


def test_several_token_markers():
    start, end = (10, 11), (12, 13, 14)
    toks = [1, 10, 11, 2, 3, 12, 13, 14, 9, 12, 13, 14]
    for n in (1, 4, len(toks)):
        assert counted(toks, n, start=start, end=end) == 2
    assert counted([2, 12, 3, 12, 13, 14, 9], 1, start=start, end=end, in_reasoning=True) == 3


def test_a_format_without_markers_counts_nothing():
    assert for_format(ChatFormat(), False) is None
    fmt = ChatFormat(think_start="<think>", think_end="</think>", think_ids=((START,), (END,)))
    c = for_format(fmt, True)
    c.feed([1, 2, END, 3])
    assert c.count == 2
