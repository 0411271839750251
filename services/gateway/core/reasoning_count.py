"""How many generated tokens were reasoning: `usage.completion_tokens_details
.reasoning_tokens` (chat) and `output_tokens_details.reasoning_tokens` (Responses).

Counted on token ids, not on text: the tokens strictly between the model's reasoning
markers (`<think>` … `</think>`, or the template's own, as mlx-lm reads them: one token
or several), the markers themselves not counted (as vLLM counts them). A prompt whose
template opens the block (`<think>\\n` in the generation prompt) starts the count inside
it. Text could not say this exactly: the detokenizer and the output parser hold text
back across tokens, and several tokens arrive in one chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.gateway.core.chat_format import ChatFormat


class ReasoningCounter:
    def __init__(self, start: Sequence[int], end: Sequence[int], *,
                 in_reasoning: bool = False) -> None:
        self.start, self.end = tuple(start), tuple(end)
        self.inside = in_reasoning
        self.count = 0
        self._tail: list[int] = []  # the last tokens, for a marker of several tokens

    def feed(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self._tail.append(t)
            marker = self.end if self.inside else self.start
            del self._tail[:-len(marker)]
            if tuple(self._tail) == marker:
                if self.inside:  # the end marker's first tokens were counted: take them back
                    self.count -= len(marker) - 1
                self.inside = not self.inside
                self._tail.clear()
            elif self.inside:
                self.count += 1


def for_format(fmt: ChatFormat, in_reasoning: bool) -> ReasoningCounter | None:
    """A counter for a model whose reasoning markers are known as token ids; None:
    nothing to count."""
    if not fmt.has_thinking or fmt.think_ids is None:
        return None
    return ReasoningCounter(*fmt.think_ids, in_reasoning=in_reasoning)
