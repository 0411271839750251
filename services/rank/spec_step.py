"""A decode step that verifies drafts (issue 46): mlx-lm's `BatchGenerator.next()` with
its decode batch's one-token step replaced, for that call, by a verify step
(services/rank/spec_verify.py) over each row's fed token and drafts.

mlx-lm's `GenerationBatch` runs one step ahead: `_next_tokens` holds each row's token
drawn last step and not yet fed (its KV is not in the cache), `_next_logprobs` that
token's logprob row, and a step *emits* the token it feeds. A verify step feeds that
token and the row's drafts; what the row emits is the fed token and its accepted drafts
(each drawn where it stands, so each with its own logprob row), and the first drawn
token that differs (or the one after the last accepted) becomes the row's next
`_next_tokens`, as a plain step's draw would. The cache keeps exactly the emitted tokens
(services/rank/spec_kv.py), the row's sampler has drawn as many tokens as plain steps
would have, and its processors' token context holds what they would: so every later
step, plain or verified, is plain decoding's.

Emitted tokens go through the row's max_tokens count and stop matcher one at a time, as
plain steps would take them: a row that ends inside its accepted run emits nothing past
its end, and the cache it leaves (for the prompt cache) is trimmed to what it emitted.

The prompt stage of the same `next()` call (prefill chunks, rows joining the decode
batch) is mlx-lm's own, untouched.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, greedy_sampler

from services.rank.sampling import SeededSampler
from services.rank.spec_verify import Verifying, verify


def next_with_drafts(gen: BatchGenerator, drafts: dict[int, list[int]]):
    """`gen.next()`, its decode batch verifying `drafts` (uid -> draft tokens) in the
    same forward pass; a batch with no row drafting steps as plain decoding does."""
    batch = gen._generation_batch
    if not any(drafts.get(uid) for uid in batch.uids):
        return gen.next()
    batch.next = lambda: verify_next(batch, drafts)  # this one call only
    try:
        return gen.next()
    finally:
        del batch.next


def verify_next(batch: GenerationBatch, drafts: dict[int, list[int]]) -> list:
    """One verify step of the decode batch: every row's responses, in emission order (a
    row may emit several tokens; a finished row's last response carries its end)."""
    mx.eval(batch._next_tokens, batch._next_logprobs)
    last = batch._next_tokens.tolist()
    last_rows = list(batch._next_logprobs)
    rows = []
    for e, uid in enumerate(batch.uids):
        # a draft past max_tokens could never be emitted: not fed
        room = max(0, batch.max_tokens[e] - batch._num_tokens[e] - 1)
        d = list(drafts.get(uid, ()))[:room]
        procs = batch.logits_processors[e] or ()
        context = batch._token_context[e].update_and_fetch(mx.array([last[e]])) \
            if procs else ()
        sampler = batch.samplers[e] if batch.samplers else None
        if sampler is None or sampler is greedy_sampler:  # mlx-lm's default: the argmax
            sampler = None
        elif not isinstance(sampler, SeededSampler):
            raise TypeError(f"row {uid}: a verify step needs the rank's SeededSampler, "
                            f"not {type(sampler).__name__}")
        rows.append(Verifying(last=last[e], drafts=d, context=context,
                              index=sampler.index if sampler is not None else 0,
                              sampling=sampler.sampling if sampler is not None else None,
                              processors=procs))
    batch._current_tokens = mx.array(last, dtype=batch._next_tokens.dtype)
    batch._current_logprobs = last_rows
    got = verify(batch.model, batch.prompt_cache, rows)
    dtype = batch._next_tokens.dtype
    responses, keep = [], []
    nexts, next_rows = [0] * len(rows), [None] * len(rows)  # a finished row's: unused
    for e, (row, v) in enumerate(zip(rows, got, strict=True)):
        fed = [row.last, *v.tokens[:-1]]  # what the cache now holds past the context
        if batch.logits_processors[e] and len(fed) > 1:
            batch._token_context[e].update_and_fetch(mx.array(fed[1:]))
        if isinstance(batch.samplers[e] if batch.samplers else None, SeededSampler):
            batch.samplers[e].index += len(v.tokens)
        batch.tokens[e].extend(fed)
        logprobs = [last_rows[e], *v.logprobs[:-1]]
        end = None
        for k, token in enumerate(fed):
            batch._num_tokens[e] += 1
            if batch._num_tokens[e] >= batch.max_tokens[e]:
                end = "length"
            if batch._matchers[e].advance(token):
                end = "stop"
            if end is None:
                responses.append(GenerationBatch.Response(batch.uids[e], token, logprobs[k],
                                                          None, None, None))
                continue
            extra = len(fed) - k - 1  # accepted after its end: not emitted, not cached
            cache = batch.extract_cache(e)
            for c in cache if extra else ():
                c.trim(extra)
            responses.append(GenerationBatch.Response(
                batch.uids[e], token, logprobs[k], end, cache,
                batch.tokens[e][:len(batch.tokens[e]) - extra]))
            break
        if end is None:
            keep.append(e)
            nexts[e], next_rows[e] = v.tokens[-1], v.logprobs[-1]
    batch._next_tokens = mx.array(nexts, dtype=dtype)
    batch._next_logprobs = next_rows
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return responses
