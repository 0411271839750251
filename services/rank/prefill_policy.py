"""Which waiting prompts rank 0 starts prefilling, and the prompt chunk of the next step.

mlx-lm's BatchGenerator runs, per `next()`, one decode step for the streams in its
batch and then one chunk of `prefill_step_size` tokens for *every* prompt in its prompt
batch, right-padded to the longest. Two costs follow (measured on a CPU rank, see
docs/design.md "Prefill scheduling"):

- padding: prompts of unequal length prefilled together each compute the longest
  chunk's positions, so eight prompts of 250-780 tokens in 512-token chunks cost eight
  times the longest;
- stalls: every prompt token of a step delays each running stream's next token by its
  compute, so a long prompt prefilled in big chunks freezes the streams for seconds.

So rank 0 decides both, per plan (the plan carries the chunk; every rank applies it):

- idle (no stream decodes): the first waiting prompt starts, with the waiting prompts
  whose remaining length is within an eighth of it (up to `prefill_batch`), in chunks
  of `prefill_step`: full speed, little padding;
- throughput (streams decode, no long prompt in prefill): the same grouping, in
  chunks of `prefill_step_decoding` (512) a step: a short prompt joins at full speed
  and the streams pause meanwhile, as under mlx_lm.server;
- steered (streams decode and a *long* prompt, more than `prefill_long_prompt` tokens
  to compute, is in prefill; `prefill_stall_ratio` > 0): the step's prompt tokens are
  the stall budget's (`StallBudget`: a step within ~`prefill_stall_ratio` x a
  decode-only step), shared by the prompts in prefill. One long prompt at a time (the
  others keep their order); a short prompt joins it rather than wait out its prefill,
  and is prefilled at the throughput chunk as it would be without it (the long one
  advances as much in those steps: one chunk size for the whole prompt batch). This is
  vLLM's long-prefill threshold idea: the prompts that would freeze the streams for
  seconds are the long ones.

A prompt served from the prefix cache but for its last token costs no prefill and
starts at once. Pure decisions on numbers the caller reads off the engine and the cache
planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAD_TOLERANCE = 1 / 8  # prompts prefilled together differ in length by at most this share
PAD_SLACK = 16  # ... or by this many tokens (short prompts)
START_CHUNK = 16  # the steered chunk before any step was measured
MIN_SPLIT = 32  # throughput mode: prompts in prefill each get at least this a step
EMA = 0.3  # weight of the newest step time in the running estimates
DAMPING = 0.5  # chunk update exponent: moves half way (in log) towards the target
# The ratio bounds the p99 of running streams' token gaps, so the chunk aims at half the
# stall it allows: step times vary (other processes, the growing context) around it.
AIM = 0.5


def similar(a: int, b: int) -> bool:
    """Prompts with `a` and `b` tokens left pad each other little."""
    return abs(a - b) <= max(PAD_SLACK, PAD_TOLERANCE * max(a, b))


class StallBudget:
    """The steered prompt chunk, from rank 0's own step times: a step that also
    prefills may take at most `ratio` x a decode-only step (issue 16: running streams'
    inter-token latency p99 within 3x their median while a long prompt prefills). The
    more prompts wait for their first token per running stream, the more of a step they
    get (`waiting / streams`, never less than 1), so a burst of new prompts is not
    starved by one stream. `ratio` 0: steering is off.

    A prompt token's cost is not linear (each forward pass re-reads the weights), so
    the chunk is steered multiplicatively towards the target from each measured steered
    step, not computed from a per-token price. Decisions only; the caller times steps."""

    def __init__(self, ratio: float, prefill_step: int) -> None:
        self.ratio = ratio
        self.prefill_step = prefill_step
        self.chunk = float(min(START_CHUNK, prefill_step))
        self.decode_s: dict[int, float] = {}  # streams → a decode-only step, running estimate

    @property
    def on(self) -> bool:
        return self.ratio > 0

    def decode_time(self, streams: int) -> float | None:
        """A decode-only step of `streams` streams (or one more or fewer), if one has
        been seen: a step's cost grows with its batch, so an estimate from another batch
        size would misjudge the stall."""
        for n in (streams, streams - 1, streams + 1):
            if n in self.decode_s:
                return self.decode_s[n]
        return None

    def observe(self, seconds: float, prompt_tokens: int, streams: int, share: float,
                steered: bool = True) -> None:
        """One step took `seconds`, computed `prompt_tokens` prompt tokens and decoded
        `streams` streams; `share` is the waiting/streams factor it was planned with,
        `steered` whether its chunk was this budget's (a throughput step's 512 tokens
        say little of a small chunk's cost)."""
        if not self.on or streams == 0 or seconds <= 0:
            return
        if prompt_tokens == 0:
            old = self.decode_s.get(streams)
            self.decode_s[streams] = seconds if old is None else (1 - EMA) * old + EMA * seconds
            return
        decode = self.decode_time(streams)
        if not steered or decode is None:
            return  # no basis at this batch size: keep the chunk until there is one
        allowed = max(self.ratio - 1.0, 0.0) * AIM * share * decode
        extra = max(seconds - decode, 1e-4)
        # From the tokens really computed (a step may have carried more than the budget,
        # or fewer: a prompt's last chunk), per share, towards what fits the allowance.
        target = prompt_tokens / share * max(allowed, 1e-4) / extra
        want = self.chunk ** (1 - DAMPING) * max(target, 1e-4) ** DAMPING
        self.chunk = min(float(self.prefill_step), max(1.0, want))

    def tokens(self, share: float) -> int:
        """Prompt tokens, in all, for the next steered step."""
        return max(1, min(self.prefill_step, int(self.chunk * share)))


def share(waiting: int, streams: int) -> float:
    return max(1.0, waiting / max(1, streams))


@dataclass
class PrefillGate:
    """One plan's admission decisions: while `more()`, ask `admits(remaining)` for each
    waiting prompt in queue order, then `chunk()`.

    `prefilling`: prompt tokens still to compute of each prompt already in the batch
    (> 0 only); `remaining` of a waiting prompt: its tokens to compute before its first
    token (prompt - cached - 1, the last one is fed by the first decode step).
    `budget`: prompt tokens a throughput step (streams decoding) computes in all;
    `steered`: a steered step's (None: steering off); a prompt with more than
    `long_prompt` tokens to compute is long (0: every prompt); `long_running`: how many
    of `prefilling` are long (the caller knows their sizes at insert)."""

    prefilling: list[int]
    decoding: bool
    prefill_batch: int
    prefill_step: int
    budget: int
    steered: int | None = None
    long_prompt: int = 0
    long_running: int = 0
    admitted: list[int] = field(default_factory=list)
    asked: int = 0  # waiting prompts asked about so far
    head_refused: bool = False  # the first one was: nothing may overtake it
    long_refused: bool = False  # a long one waits: no later long one overtakes it

    def in_prefill(self) -> list[int]:
        return self.prefilling + self.admitted

    def is_long(self, remaining: int) -> bool:
        return self.steered is not None and remaining > self.long_prompt

    def steering(self) -> bool:
        """Is this plan's step steered (streams decode while a long prompt prefills)?"""
        return self.decoding and self.steered is not None and self.longs() > 0

    def longs(self) -> int:
        return self.long_running + sum(1 for n in self.admitted if self.is_long(n))

    def boosted(self) -> bool:
        """A steered step that also prefills short prompts: at the throughput chunk."""
        return self.steering() and len(self.in_prefill()) > self.longs()

    def more(self) -> bool:
        """Is there room for another prompt in prefill at this plan?"""
        n = len(self.in_prefill())
        if n >= self.prefill_batch or self.head_refused:
            return False
        if not self.decoding or n == 0 or self.steering():
            return True
        # Throughput: a budget split into crumbs buys nothing: another prompt joins
        # only if each keeps MIN_SPLIT tokens a step (a small model's cheap steps).
        return self.budget // (n + 1) >= MIN_SPLIT

    def admits(self, remaining: int) -> bool:
        """Start this waiting prompt now? Ask in queue order. Later prompts of similar
        length may join the queue's head, never overtake it: once the head is refused
        (it does not fit what is in prefill), nothing more starts at this plan. While
        streams decode, long prompts start one at a time, in order; short ones join a
        steered one (its small chunks pad little) and may pass a long one that waits."""
        first = self.asked == 0
        self.asked += 1
        if remaining <= 0:
            return True  # nothing to prefill: it only takes the next decode step
        if not self.more():
            if first:
                self.head_refused = True
            return False
        current = self.in_prefill()
        if self.decoding and self.is_long(remaining):
            ok = not self.long_refused and not self.steering()
            self.long_refused |= not ok
        elif self.steering():
            ok = True
        else:
            ok = not current or similar(remaining, max(current))
            if not ok and first:
                self.head_refused = True
        if ok:
            self.admitted.append(remaining)
        return ok

    def withdraw(self, remaining: int) -> None:
        """An admitted prompt stays waiting after all (it waits for a running prefill)."""
        if remaining > 0:
            self.admitted.remove(remaining)

    def chunk(self) -> int:
        """Prompt tokens per prompt for the next step."""
        if not self.decoding:
            return self.prefill_step
        n = max(1, min(len(self.in_prefill()), self.prefill_batch))
        per = self.budget // n
        if self.steering() and not self.boosted():
            per = self.steered // n
        return max(1, min(self.prefill_step, per))
