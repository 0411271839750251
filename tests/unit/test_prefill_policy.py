"""Rank 0's prefill decisions (services/rank/prefill_policy.py): pure, numbers in."""

from __future__ import annotations

from services.rank.prefill_policy import PrefillGate, StallBudget, share, similar


def gate(prefilling=(), decoding=False, batch=8, step=512, budget=16, steered=None,
         long_prompt=0, long_running=0) -> PrefillGate:
    return PrefillGate(list(prefilling), decoding, batch, step, budget, steered, long_prompt,
                       long_running)


def admitted(g: PrefillGate, waiting: list[int]) -> list[int]:
    out = []
    for rem in waiting:
        if not g.more():
            break
        if g.admits(rem):
            out.append(rem)
    return out


def test_idle_groups_prompts_of_similar_length_and_skips_the_rest():
    g = gate()
    assert admitted(g, [400, 780, 420, 253, 390, 1200]) == [400, 420, 390]
    assert g.chunk() == 512  # nothing decodes: full speed


def test_idle_group_is_capped_by_prefill_batch():
    g = gate(batch=2)
    assert admitted(g, [300, 300, 300]) == [300, 300]


def test_while_streams_decode_a_small_budget_takes_one_prompt_at_a_time():
    g = gate(decoding=True, budget=12)
    assert admitted(g, [400, 400, 10]) == [400]
    assert g.chunk() == 12
    busy = gate(prefilling=[100], decoding=True)
    assert not busy.more()  # the next one waits for the running prefill


def test_while_streams_decode_a_long_prompt_is_steered_and_short_ones_join_it():
    """Prompts over `long_prompt` get the stall budget's chunk; a shorter one behind a
    long one joins it instead of waiting out its prefill, at the throughput chunk it
    would get without it."""
    g = gate(decoding=True, budget=512, steered=12, long_prompt=2048)
    assert admitted(g, [3000]) == [3000]
    assert g.steering() and not g.boosted() and g.chunk() == 12
    g = gate(decoding=True, budget=512, steered=12, long_prompt=2048)
    assert admitted(g, [3000, 300]) == [3000, 300]
    assert g.boosted() and g.chunk() == 256
    # Long prompts go one at a time, in order; a short one may pass a waiting long one.
    g = gate(prefilling=[2500], decoding=True, budget=512, steered=12, long_prompt=2048,
             long_running=1)
    assert admitted(g, [4000, 300, 3000, 200]) == [300, 200]
    assert g.chunk() == 170
    # A long prompt past its threshold stays long: the caller says so (long_running).
    g = gate(prefilling=[900], decoding=True, budget=512, steered=12, long_prompt=2048,
             long_running=1)
    assert g.steering() and not g.boosted() and g.chunk() == 12


def test_short_prompts_while_streams_decode_take_the_throughput_chunk():
    g = gate(decoding=True, budget=512, steered=12, long_prompt=2048)
    assert admitted(g, [300, 310, 1200]) == [300, 310]
    assert not g.steering() and g.chunk() == 256
    # Steering off (ratio 0): a long prompt is prefilled like a short one.
    g = gate(decoding=True, budget=512, steered=None, long_prompt=2048)
    assert admitted(g, [3000]) == [3000] and not g.steering() and g.chunk() == 512
    # Nothing decodes: full speed, whatever the length.
    g = gate(decoding=False, budget=512, steered=12, long_prompt=2048)
    assert admitted(g, [3000]) == [3000] and g.chunk() == 512


def test_while_streams_decode_a_big_budget_is_shared_by_similar_prompts():
    g = gate(decoding=True, budget=90)  # 90 // 3 < 32: three do not fit
    assert admitted(g, [300, 900, 310, 305]) == [300, 310]
    assert g.chunk() == 45


def test_a_prompt_served_by_the_cache_but_its_last_token_starts_at_once():
    g = gate(prefilling=[50], decoding=False, batch=1)
    assert g.admits(0)
    assert g.in_prefill() == [50]


def test_chunk_splits_the_budget_over_the_prompts_in_prefill():
    g = gate(prefilling=[300, 310], decoding=True, budget=20)
    assert g.chunk() == 10
    assert gate(prefilling=[300] * 5, decoding=True, budget=3).chunk() == 1


def test_withdraw_undoes_an_admission():
    g = gate()
    assert g.admits(100)
    g.withdraw(100)
    assert g.in_prefill() == []
    g.withdraw(0)  # a zero-cost admission was never counted


def test_similar():
    assert similar(400, 440) and not similar(400, 470)
    assert similar(10, 25)  # short prompts: an absolute slack


def test_stall_budget_steers_the_chunk_to_the_target_ratio():
    """A cost model with a fixed part per forward pass (the weight read) and a linear
    part: the chunk settles where a step is ~2x a decode-only step (half the stall a
    ratio of 3 allows: the ratio bounds the p99, noise comes on top)."""
    decode, fixed, per_token = 0.09, 0.06, 0.006
    b = StallBudget(3.0, prefill_step=512)
    b.observe(decode, 0, streams=4, share=1.0)
    for _ in range(40):
        n = b.tokens(1.0)
        b.observe(decode + fixed + per_token * n, n, streams=4, share=1.0)
    n = b.tokens(1.0)
    step = decode + fixed + per_token * n
    assert 1.8 <= step / decode <= 2.2, (n, step / decode)


def test_stall_budget_gives_waiting_prompts_more_when_they_outnumber_streams():
    b = StallBudget(3.0, prefill_step=512)
    assert b.tokens(share(waiting=7, streams=1)) == 16 * 7
    assert b.tokens(share(waiting=1, streams=4)) == 16
    assert b.tokens(share(waiting=100, streams=1)) == 512  # never above prefill_step


def test_stall_budget_needs_a_decode_only_step_and_a_steered_step():
    b = StallBudget(3.0, prefill_step=512)
    b.observe(5.0, 16, streams=4, share=1.0)  # no decode-only step seen yet: no basis
    assert b.tokens(1.0) == 16
    b.observe(0.1, 0, streams=4, share=1.0)
    b.observe(9.0, 512, streams=4, share=1.0, steered=False)  # a throughput step
    assert b.tokens(1.0) == 16
    assert not StallBudget(0.0, prefill_step=512).on


def test_stall_budget_steers_from_the_tokens_really_computed():
    """A step that carried twice the budget (short prompts joined) and took twice the
    allowance says the budget itself was right: the chunk holds."""
    decode = 0.125  # exact in binary: the check is not about rounding
    b = StallBudget(3.0, prefill_step=512)
    b.observe(decode, 0, streams=4, share=1.0)
    allowed = (3.0 - 1.0) * 0.5 * decode
    b.observe(decode + 2 * allowed, 32, streams=4, share=1.0)
    assert b.tokens(1.0) == 16


def test_stall_budget_judges_a_step_only_against_a_decode_step_of_its_batch_size():
    """A decode-only step seen at 1 stream says nothing of one at 7: the chunk holds
    (it once collapsed to 1 token against a stale 1-stream estimate)."""
    b = StallBudget(3.0, prefill_step=512)
    b.observe(0.004, 0, streams=1, share=1.0)
    for _ in range(20):
        b.observe(0.014, 20, streams=7, share=1.0)
    assert b.tokens(1.0) == 16
    b.observe(0.008, 0, streams=7, share=1.0)  # now it has a basis at 7
    b.observe(0.030, 16, streams=7, share=1.0)
    assert b.tokens(1.0) < 16


def test_the_head_of_the_queue_is_never_overtaken():
    """A 1000-token prompt that does not fit the prompts in prefill waits for them to
    finish; shorter ones arriving behind it do not keep joining them (starvation)."""
    g = gate(prefilling=[300])
    assert not g.admits(1000)
    assert not g.more()
    assert not g.admits(305)  # similar to what runs, but behind the refused head
    assert g.in_prefill() == [300]
    # A WAIT-ed head (withdrawn after admission) does not block the ones behind it.
    g = gate()
    assert g.admits(400)
    g.withdraw(400)
    assert g.more() and g.admits(410)
