"""`usage` in OpenAI's shape, with the prefix cache's `prompt_tokens_details.cached_tokens`,
the same in a body and in the include_usage chunk."""

from __future__ import annotations

from services.gateway.core.generation import Final, Finish
from services.gateway.core.streaming import Shape


def test_usage_carries_cached_tokens_in_openais_shape():
    f = Final(Finish.STOP, prompt_tokens=40, completion_tokens=7, cached_tokens=32)
    assert f.usage() == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47,
                         "prompt_tokens_details": {"cached_tokens": 32},
                         "completion_tokens_details": {"reasoning_tokens": 0}}
    assert Final(Finish.STOP, 3, 1).usage()["prompt_tokens_details"] == {"cached_tokens": 0}


def test_body_and_usage_chunk_give_the_same_usage():
    f = Final(Finish.LENGTH, prompt_tokens=10, completion_tokens=2, cached_tokens=9)
    for chat in (True, False):
        shape = Shape(chat, "r-1", "m", include_usage=True)
        assert shape.body("hi", f)["usage"] == shape.usage_chunk(f)["usage"] == f.usage()
        assert shape.usage_chunk(f)["choices"] == []
