"""Structured output end to end with the real `openai` client: `lockstep up` serving the
embedded random-weight model at TP=2 ("tiny") and, deployed next to it through the admin
API, a copy at PP=2 ("tiny-pp"). Constrained decoding makes even random weights emit
JSON valid for the schema asked for (checked with `jsonschema`), a required tool call
whose arguments validate against the tool's parameters, and both ranks of each
deployment emit the same tokens (their removal records' tokens_sha). A schema
llguidance cannot compile is a 400 naming it, before any rank sees it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from common.home import Paths
from services.rank.removals import read_removals, removals_path
from tests.gwutil import GaveUp, free_port, poll_until
from tests.support.processes import interrupt, up_argv

ROOT = Path(__file__).resolve().parents[2]
MODES = {"tp": "tiny", "pp": "tiny-pp"}
pytestmark = pytest.mark.timeout(600)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                  "maxItems": 3}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["utc", "local"]}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    home = tmp_path_factory.mktemp("uphome")
    port = free_port()
    out = home / "up.out"
    with open(out, "wb") as log:
        proc = subprocess.Popen(up_argv(home, port, "--tp", "2"), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def serving(model: str) -> bool:
            if proc.poll() is not None:
                raise GaveUp(f"lockstep up exited: {out.read_text()[-3000:]}")
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": model, "prompt": "hi", "max_tokens": 1})
            return r.status_code == 200

        poll_until(lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, 240,
                   "lockstep up to be ready", interval=0.2)
        hdr = {"authorization": f"Bearer {(home / 'admin.token').read_text().strip()}"}
        # The same weights under another name, deployed at PP=2 beside the TP=2 one.
        pp_model = home / "pp-model" / MODES["pp"]
        shutil.copytree(Paths(home).models / "tiny", pp_model)
        r = httpx.post(url + "/admin/api/cluster/deployments", headers=hdr, timeout=300,
                       json={"model_path": str(pp_model), "tp": 1, "pp": 2, "wait": True})
        assert r.status_code == 200, r.text
        poll_until(lambda: serving(MODES["pp"]) and serving(MODES["tp"]), 240,
                   "both deployments to serve", interval=0.2)
        deps = httpx.get(url + "/admin/api/cluster/deployments", headers=hdr,
                         timeout=10).json()["deployments"]
        by_model = {d["model"]: d["deployment_id"] for d in deps if d["state"] == "serving"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield {"client": client, "home": home, "deps": by_model, "url": url}
    finally:
        interrupt(proc, 90)


def ranks_agree(live, mode: str, rid: str) -> dict:
    """Both ranks' removal record of `rid` (polled: a rank writes it when it removes the
    request), equal in every field the ranks share."""
    paths, dep = Paths(live["home"]), live["deps"][MODES[mode]]

    def records():
        got = [[r for r in read_removals(removals_path(paths, dep, k)) if r["request_id"] == rid]
               for k in (0, 1)]
        return got if all(got) else None

    r0, r1 = poll_until(records, 30, f"both ranks' removal record of {rid}")
    keys = ("uid", "step", "reason", "n_tokens", "tokens_sha")
    assert [{k: r[k] for k in keys} for r in r0] == [{k: r[k] for k in keys} for r in r1]
    return r0[0]


def chat(live, mode: str, **kw):
    raw = live["client"].chat.completions.with_raw_response.create(
        model=MODES[mode], messages=ASK, **kw)
    return raw.headers["x-lockstep-request-id"], raw.parse()


@pytest.mark.parametrize("mode", list(MODES))
def test_json_object(live, mode):
    rid, resp = chat(live, mode, response_format={"type": "json_object"}, max_tokens=400,
                     temperature=0.7, seed=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)
    assert ranks_agree(live, mode, rid)["reason"] == "stop"


@pytest.mark.parametrize("mode", list(MODES))
def test_json_schema_greedy_and_seeded_and_streamed(live, mode):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        rid, resp = chat(live, mode, response_format=rf, max_tokens=120, **kw)
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
        ranks_agree(live, mode, rid)
    stream = live["client"].chat.completions.create(
        model=MODES[mode], messages=ASK, response_format=rf, max_tokens=120, temperature=0.9,
        seed=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("mode", list(MODES))
def test_required_and_named_tool_calls(live, mode):
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        rid, resp = chat(live, mode, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                         max_tokens=120, temperature=0.8, seed=3)
        c = resp.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.function.name in names
        schema = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
        ranks_agree(live, mode, rid)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(live):
    client = live["client"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODES["tp"], messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "odd", "schema": {
                "type": "object", "properties": {"a": {"type": "strange"}}}}})
    assert e.value.param == "response_format.json_schema.schema"
    assert e.value.code == "invalid_json_schema" and "'odd'" in e.value.message
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "if": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODES["pp"], messages=ASK, tools=[bad_tool],
                                       tool_choice="required")
    assert e.value.param == "tools.0.function.parameters"
