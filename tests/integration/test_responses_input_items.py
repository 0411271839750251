"""`GET /v1/responses/{id}/input_items` and reasoning token counts, through the whole
gateway with the real `openai` client: a real uvicorn server and signed channels, a fake
rank 0 scripted to emit what a thinking Qwen3-Coder-style model would, and the
"thinking" tokenizer (tests/support/thinker_model.py).

input_items: a chain's earlier items (inputs and outputs, under the ids they had) then
the response's own input, newest first by default; the SDK's auto-paging walks every
page; a bad parameter is a 400 naming it; an unknown or deleted id a 404.
reasoning_tokens: the tokens between the think markers, in Responses' and chat's usage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from common.envelope import Key
from common.keys import ensure_cluster_key
from models.tinymodel import build_model
from services.gateway.core.detok import load_tokenizer
from services.gateway.core.settings import GatewaySettings
from tests.fakes.gateway_fakes import FakeRank0, FakeSupervisor
from tests.gwutil import GatewayThread, free_port, poll_until
from tests.support.fake_gateway import FakeGateway
from tests.support.thinker_model import thinker_model

CALL = "<tool_call>\n<function=add>\n<parameter=a>\n{}\n</parameter>\n</function>\n</tool_call>"
TOOLS = [{"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("gwhome")
    key: Key = ensure_cluster_key(home / "keys" / "cluster.key")
    tiny = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")
    model = thinker_model(tiny, tmp_path_factory.mktemp("t") / "thinker", coder=True)
    rank = FakeRank0(key).start()
    sup = FakeSupervisor(key, rank, str(model)).start()
    settings = GatewaySettings(home=home, port=free_port(), admin_endpoint=sup.admin_endpoint,
                               events_endpoint=sup.events_endpoint, refresh_s=0.5)
    gw = GatewayThread(settings, key).start()
    poll_until(lambda: gw.gw.cluster.backends, 10, "the fake deployment to be picked up")
    load_tokenizer(model)  # loaded (and kept) before the tests run: env.tok
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=20)
    yield FakeGateway(rank=rank, sup=sup, gw=gw, model=model, settings=settings, key=key,
                      home=home, url=gw.url).with_client(c)
    gw.stop()
    sup.stop()
    rank.stop()


def say(env: FakeGateway, text: str) -> list[int]:
    """Script rank 0 to emit `text` (each `</think>` as its one token); the ids."""
    tok = env.tok
    pieces = text.replace("</think>", "\0</think>\0").split("\0")
    ids = [i for p in pieces for i in (tok.hf.convert_tokens_to_ids([p]) if p == "</think>"
                                       else tok.encode(p))]
    env.rank.script = lambda g: list(ids)
    return ids


def dumped(items) -> list[dict]:
    return [i.model_dump(exclude_none=True) for i in items]


@pytest.mark.timeout(60)
def test_input_items_of_a_chain_under_stable_ids(env):
    c, m = env.c, env.model_name
    say(env, "use the tool</think>\n" + CALL.format(7))
    first = c.responses.create(model=m, input="add 7", tools=TOOLS, instructions="Be terse.")
    page = c.responses.input_items.list(first.id)
    assert page.object == "list" and page.has_more is False
    [user] = page.data
    assert user.type == "message" and user.role == "user" and user.id.startswith("msg_")
    assert [p.model_dump(exclude_none=True) for p in user.content] == [
        {"type": "input_text", "text": "add 7"}]  # instructions are not an input item
    assert page.first_id == page.last_id == user.id

    call = next(o for o in first.output if o.type == "function_call")
    say(env, "done</think>\nIt is 14.")
    second = c.responses.create(model=m, previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "14"}])
    asc = c.responses.input_items.list(second.id, order="asc").data
    # The chain, as OpenAI lists it: the first turn's input and output, then this input.
    assert [i.type for i in asc] == ["message", "reasoning", "function_call",
                                     "function_call_output"]
    assert asc[0].id == user.id  # the same item, the same id, in every response of the chain
    assert [i.id for i in asc[1:3]] == [o.id for o in first.output]
    assert asc[1].content[0].text == "use the tool"
    assert (asc[2].call_id, json.loads(asc[2].arguments)) == (call.call_id, {"a": 7})
    assert asc[3].call_id == call.call_id and asc[3].output == "14"
    assert asc[3].id.startswith("fco_") and asc[3].status == "completed"
    desc = c.responses.input_items.list(second.id)  # OpenAI's default order: newest first
    assert [i.id for i in desc.data] == [i.id for i in reversed(asc)]
    assert (desc.first_id, desc.last_id) == (asc[-1].id, asc[0].id)
    # Its own output is not among its input items.
    assert not {o.id for o in second.output} & {i.id for i in asc}


@pytest.mark.timeout(60)
def test_paging_limit_after_before(env):
    c, m = env.c, env.model_name
    say(env, "x</think>ok")
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    msgs[2] = {"role": "assistant", "content": "m2"}
    r = c.responses.create(model=m, input=[*msgs, {"role": "developer", "content": "m4"}])
    first = c.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["m0", "m1"] and first.has_more
    texts = [i.content[0].text for i in c.responses.input_items.list(r.id, limit=2)]
    assert texts == ["m4", "m3", "m2", "m1", "m0"]  # the SDK follows `after` to the end
    every = c.responses.input_items.list(r.id, order="asc").data
    assert every[2].role == "assistant" and every[2].content[0].type == "output_text"
    assert every[2].id.startswith("msg_") and every[4].role == "developer"
    ids = [i.id for i in every]
    got = httpx.get(f"{env.url}/v1/responses/{r.id}/input_items",
                    params={"order": "asc", "before": ids[3], "limit": 2}, timeout=20).json()
    assert [d["id"] for d in got["data"]] == ids[1:3] and got["has_more"] is True
    got = httpx.get(f"{env.url}/v1/responses/{r.id}/input_items",
                    params={"order": "asc", "after": ids[0], "before": ids[3]}, timeout=20).json()
    assert [d["id"] for d in got["data"]] == ids[1:3] and got["has_more"] is False
    got = httpx.get(f"{env.url}/v1/responses/{r.id}/input_items",
                    params={"after": ids[0]}, timeout=20).json()  # desc: nothing after the oldest
    assert got == {"object": "list", "data": [], "first_id": None, "last_id": None,
                   "has_more": False}
    included = c.responses.input_items.list(r.id, include=["message.output_text.logprobs"])
    assert len(included.data) == 5


@pytest.mark.timeout(60)
def test_bad_parameters_400_and_unknown_ids_404(env):
    c, m, url = env.c, env.model_name, env.url
    say(env, "x</think>ok")
    r = c.responses.create(model=m, input="hi")
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"limit": "ten"}, "limit"), ({"order": "newest"}, "order"),
                          ({"after": "msg_nope"}, "after"), ({"before": ""}, "before"),
                          ({"include[]": "everything"}, "include"), ({"page": 2}, "page")):
        resp = httpx.get(f"{url}/v1/responses/{r.id}/input_items", params=params, timeout=20)
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == param, (params, err)
        assert err["type"] == "invalid_request_error" and err["message"].startswith(param)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.input_items.list(r.id, limit=500)
    assert e.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.input_items.list("resp_unknown")
    assert e.value.body["code"] == "not_found"
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list(r.id)
    say(env, "x</think>ok")
    unstored = c.responses.create(model=m, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list(unstored.id)


@pytest.mark.timeout(60)
def test_reasoning_tokens_count_the_tokens_inside_the_block(env):
    c, m = env.c, env.model_name
    ids = say(env, "seven plus nothing</think>\n\nIt is 7.")
    thought = ids.index(env.tok.hf.convert_tokens_to_ids("</think>"))
    assert thought >= 2  # the block opened by the template holds several tokens
    r = c.responses.create(model=m, input="add 7", reasoning={"effort": "high"})
    assert r.output_text == "It is 7." and r.usage.output_tokens == len(ids)
    assert r.usage.output_tokens_details.reasoning_tokens == thought
    with c.responses.stream(model=m, input="add 7", reasoning={"effort": "high"}) as s:
        final = s.get_final_response()
    assert final.usage.output_tokens_details.reasoning_tokens == thought
    chat = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "add 7"}])
    assert chat.usage.completion_tokens == len(ids)
    assert chat.usage.completion_tokens_details.reasoning_tokens == thought
    stream = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "add 7"}],
                                       stream=True, stream_options={"include_usage": True})
    usage = [ch.usage for ch in stream if ch.usage is not None]
    assert usage[-1].completion_tokens_details.reasoning_tokens == thought
    plain = say(env, "Plain.")
    off = c.responses.create(model=m, input="add 7", reasoning={"effort": "none"})
    assert off.usage.output_tokens == len(plain)
    assert off.usage.output_tokens_details.reasoning_tokens == 0
