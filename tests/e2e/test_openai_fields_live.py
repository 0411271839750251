"""Every OpenAI request field against a live TP=2 deployment (`lockstep up`, the embedded
model served as the Hugging Face repo id `acme/tiny-chat` from a fake local HF cache),
with the real `openai` client: the field table walked row by row, `n` choices, template
kwargs, and /v1/models. One deployment for the module."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from common.request_params import CHAT
from models.tinymodel import build_model
from services.gateway.openai import fields as rf
from tests.support.params import samples
from tests.support.up_cluster import UpOptions, up_cluster

REPO_ID = "acme/tiny-chat"
REV = "89abcdef0123456789abcdef0123456789abcdef"
MSGS = [{"role": "user", "content": "Tell me about the red train."}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]

# What the walk sends for each row (the field, plus what it needs next to it). Honoured and
# harmless rows must answer 200 (their effects are tested per field elsewhere); refused
# rows a 400 naming the field.
SAMPLES: dict[str, dict] = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto"},
    "functions": {"functions": [{"name": "add"}]},
    "logit_bias": {"logit_bias": {"17": 5}},
    "logprobs": {"logprobs": True},  # completions: an int (below)
    "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 2},
    "messages": {},
    "metadata": {"metadata": {"k": "v"}},
    "modalities": {"modalities": ["text"]},
    "model": {},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": TOOLS},
    "prediction": {"prediction": {"type": "content", "content": "the train"}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt": {},
    "prompt_cache_key": {"prompt_cache_key": "k1"},
    "prompt_cache_options": {"prompt_cache_options": {"ttl": "5m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "in_memory"},
    "reasoning_effort": None,  # honoured only by a template that reads it: tested below
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "u-1"},
    "seed": {"seed": 3},
    "service_tier": {"service_tier": "auto"},
    "stop": {"stop": ["zz"]},
    "store": {"store": False},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": "end"},
    "temperature": {"temperature": 0.7},
    "tool_choice": {"tool_choice": "required", "tools": TOOLS},
    "tools": {"tools": TOOLS},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "u-1"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {}},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "min_p": {"min_p": 0.1},
    "repetition_context_size": {"repetition_penalty": 1.1, "repetition_context_size": 16},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "top_k": {"top_k": 5},
}
# Every other declared request parameter (common/request_params.py, e.g. XTC): a value in
# its range, so a parameter declared later is walked too.
for _name, _value in samples(CHAT).items():
    SAMPLES.setdefault(_name, {_name: _value})
COMPLETIONS_SAMPLES = {"logprobs": {"logprobs": 2}}


def fake_hf_cache(root: Path) -> Path:
    repo = root / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(build_model(root / "build" / "tiny", preset="tiny"), repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return repo / "snapshots" / REV


@dataclass(frozen=True)
class Live:
    url: str
    snap: Path  # the model's snapshot in the fake HF cache


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    hf = tmp_path_factory.mktemp("hf")
    snap = fake_hf_cache(hf)
    opts = UpOptions(model=REPO_ID, ready="ready", env={
        "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": None})
    with up_cluster(tmp_path_factory.mktemp("up"), opts) as up:
        yield Live(up.url, snap)


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(live: Live, endpoint: str, extra: dict) -> httpx.Response:
    base = ({"model": REPO_ID, "messages": MSGS} if endpoint == rf.CHAT
            else {"model": REPO_ID, "prompt": "the red train"})
    path = "/v1/chat/completions" if endpoint == rf.CHAT else "/v1/completions"
    return httpx.post(live.url + path, json={"max_tokens": 2, **base, **extra}, timeout=60)


@pytest.mark.timeout(60)
def test_models_lists_the_repo_id(live):
    models = client(live).models.list().data
    assert [m.id for m in models] == [REPO_ID]
    assert models[0].owned_by == "acme"
    assert models[0].created == int((live.snap / "config.json").stat().st_mtime)
    by_path = client(live).completions.create(model=str(live.snap), prompt="hi", max_tokens=2)
    assert by_path.model == REPO_ID  # the directory names it too; answered with its id
    with pytest.raises(openai.NotFoundError):
        client(live).completions.create(model="acme/other", prompt="hi", max_tokens=2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("endpoint", [rf.CHAT, rf.COMPLETIONS])
def test_the_field_table_walked_against_the_server(live, endpoint):
    wrong = []
    for name, row in rf.BY_ENDPOINT[endpoint].items():
        extra = (COMPLETIONS_SAMPLES.get(name) if endpoint == rf.COMPLETIONS else None) \
            or SAMPLES[name]
        if extra is None:
            continue
        if name not in extra and name not in ("messages", "prompt", "model"):
            raise AssertionError(f"the sample for {name} does not send it")
        r = post(live, endpoint, extra)
        want = 400 if row.support(endpoint) is rf.Support.REFUSED else 200
        got = (r.status_code, r.json()["error"].get("param") if r.status_code != 200 else None)
        if got != (want, name if want == 400 else None):
            wrong.append((name, row.support(endpoint).value, r.status_code, r.text[:200]))
    r = post(live, endpoint, {"guided_json": {}})  # another server's extension: named
    assert (r.status_code, r.json()["error"]["code"]) == (400, "unknown_parameter")
    assert not wrong, "\n".join(map(str, wrong))


@pytest.mark.timeout(120)
def test_n_choices_each_its_own_seed(live):
    c = client(live)
    greedy = c.chat.completions.create(model=REPO_ID, messages=MSGS, n=3, temperature=0,
                                       max_tokens=8)
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in greedy.choices}) == 1  # greedy: equal
    assert greedy.usage.completion_tokens == 3 * 8
    one = c.chat.completions.create(model=REPO_ID, messages=MSGS, temperature=0, max_tokens=8)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    seeded = c.completions.create(model=REPO_ID, prompt="a robot builds", n=3, seed=11,
                                  temperature=1.0, max_tokens=8)
    single = [c.completions.create(model=REPO_ID, prompt="a robot builds", seed=11 + i,
                                   temperature=1.0, max_tokens=8).choices[0].text
              for i in range(3)]
    assert [ch.text for ch in seeded.choices] == single  # choice i = seed + i
    assert len(set(single)) > 1
    chunks = list(c.chat.completions.create(model=REPO_ID, messages=MSGS, n=2, seed=5,
                                            max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    again = c.chat.completions.create(model=REPO_ID, messages=MSGS, n=2, seed=5, max_tokens=6)
    assert [ch.message.content for ch in again.choices] == [texts[0], texts[1]]
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=REPO_ID, messages=MSGS, n=17)
    assert ei.value.body["param"] == "n"


@pytest.mark.timeout(60)
def test_template_kwargs_are_checked(live):
    r = post(live, rf.CHAT, {"chat_template_kwargs": ["enable_thinking"]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs")
    r = post(live, rf.CHAT, {"chat_template_kwargs": {"tokenize": True}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs.tokenize")
    r = post(live, rf.CHAT, {"reasoning_effort": "low"})  # this template never reads it
    assert (r.status_code, r.json()["error"]["code"]) == (400, "unsupported_value")
    r = post(live, rf.CHAT, {"chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert r.status_code == 200 and json.loads(r.text)["choices"][0]["message"]["role"] == "assistant"
