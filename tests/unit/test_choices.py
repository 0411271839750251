"""n > 1 (services/gateway/core/choices.py): one GENERATE per choice with seed + i, and the
merged usage/outcome of the response."""

from __future__ import annotations

from common.messages import Generate, Sampling
from common.request_params import SEED_MOD
from services.gateway.core.choices import choice_messages, merged_final
from services.gateway.core.errors import ApiError
from services.gateway.core.generation import Final, Finish


def test_each_choice_its_own_request_and_seed():
    g = Generate(request_id="chatcmpl-x", prompt=[1, 2], max_tokens=4,
                 sampling=Sampling(temperature=0.5, seed=SEED_MOD - 1))
    ms = choice_messages(g, 3)
    assert [m.request_id for m in ms] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [m.sampling.seed for m in ms] == [SEED_MOD - 1, 0, 1]  # wraps into the rank's range
    assert all(m.prompt == [1, 2] and m.max_tokens == 4 and m.sampling.temperature == 0.5
               for m in ms)
    assert g.sampling.seed == SEED_MOD - 1  # the request's own record is not changed
    assert choice_messages(g, 1) == [g]  # n = 1: the request as it was
    default = choice_messages(Generate(request_id="r", prompt=[1], max_tokens=1), 2)
    assert [m.sampling.seed for m in default] == [0, 1]  # a record's seed is always set


def test_merged_usage_counts_the_prompt_once():
    a = Final(Finish.LENGTH, 10, 4, model_ttft_ms=5.0, visible_ttft_ms=7.0)
    b = Final(Finish.STOP, 10, 2, model_ttft_ms=3.0, visible_ttft_ms=None)
    m = merged_final([a, b])
    assert m.usage()["prompt_tokens"] == 10 and m.usage()["completion_tokens"] == 6
    assert (m.model_ttft_ms, m.visible_ttft_ms, m.error) == (3.0, 7.0, None)
    err = ApiError(502, "boom", code="backend_error")
    assert merged_final([a, Final("error", 10, 0, error=err)]).error is err
    assert merged_final([a]) is a
