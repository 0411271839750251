"""The agent session's conversation and its requests (bench/agent_session.py).

`Session` holds one session's text: a system prompt, the tool list, and the turns so far
(a user message — the task, then tool results — and the server's reply to it), rendered
as an OpenAI chat request or as the same conversation in Anthropic's Messages form.
Every text is `prose` seeded by the session key, so two servers given the same key see
the same prompt, and another key shares no prefix with it beyond the template's.
"""

from __future__ import annotations

import asyncio
import json
import time

from bench.chat_client import REQUEST_TIMEOUT_S, Reply
from bench.cpu_breakdown import Snapshot
from bench.sse_http import HttpError, post_json
from bench.workload import prose

TASK_TOKENS = 60
EMPTY_REPLY = "."  # an empty reply still makes an assistant turn (Anthropic refuses "")


def tools_for(tok, cfg, key: str) -> list[dict]:
    """`cfg.tools` function tools in OpenAI's chat form, each with a prose description and
    three typed parameters (what an agent's tool list looks like to a template)."""
    out = []
    for i in range(cfg.tools):
        out.append({"type": "function", "function": {
            "name": f"tool_{i:02d}",
            "description": prose(tok, 40, f"{key}/tool{i}"),
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "a file or directory"},
                "count": {"type": "integer", "description": "how many"},
                "recursive": {"type": "boolean"}}, "required": ["path"]}}})
    return out


class Session:
    def __init__(self, tok, cfg, key: str, tools: list[dict]) -> None:
        self.tok, self.cfg, self.key = tok, cfg, key
        self.cfg_max_tokens = cfg.max_tokens
        self.system = prose(tok, cfg.system_tokens, f"{key}/system")
        self.tools = tools
        self.turns: list[list[str | None]] = []  # [user text, reply or None]
        self._next_user()

    def _next_user(self) -> None:
        t = len(self.turns)
        if t == 0:
            text = "Task: " + prose(self.tok, TASK_TOKENS, f"{self.key}/task")
        else:
            name = f"tool_{(t - 1) % max(1, self.cfg.tools):02d}"
            text = f"Result of {name}:\n" + prose(self.tok, self.cfg.tool_result_tokens,
                                                  f"{self.key}/result{t}")
        self.turns.append([text, None])

    def reply(self, text: str) -> None:
        """Append the server's reply (replies "own"), or the same canned text for every
        server (replies "fixed"): then each server gets exactly the same prompts, and the
        servers compute the same tokens every turn (their own greedy replies may differ,
        and a re-tokenized reply matches each one's cache to a different depth)."""
        if self.cfg.replies == "fixed":
            text = prose(self.tok, self.cfg_max_tokens, f"{self.key}/reply{len(self.turns)}")
        self.turns[-1][1] = text or EMPTY_REPLY
        self._next_user()

    def chat_messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.system}]
        for user, reply in self.turns:
            out.append({"role": "user", "content": user})
            if reply is not None:
                out.append({"role": "assistant", "content": reply})
        return out

    def messages_body(self, model: str) -> dict:
        """The same conversation as an Anthropic Messages request (streamed)."""
        msgs = [m for m in self.chat_messages() if m["role"] != "system"]
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in self.tools]
        return {"model": model, "system": self.system, "messages": msgs, "tools": tools,
                "max_tokens": self.cfg_max_tokens, "temperature": 0.0, "stream": True}


async def messages_turn(url: str, model: str, s: Session) -> Reply:
    """One streamed /v1/messages request, timed as bench/chat_client.chat times chat:
    TTFT at the first non-empty text_delta."""
    r = Reply(time.monotonic())
    parts: list[str] = []
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        resp = await post_json(url + "/v1/messages", s.messages_body(model))
        try:
            if resp.status != 200:
                raise RuntimeError(f"{url}: {HttpError(resp.status, await resp.read())}")
            async for line in resp.lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic() - r.sent_at
                d = json.loads(line[6:])
                kind = d.get("type")
                if kind == "error":
                    raise RuntimeError(f"{url}: stream error {d.get('error')}")
                if kind == "message_start":
                    u = d["message"]["usage"]
                    r.prompt_tokens = u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0)
                    r.cached_tokens = u.get("cache_read_input_tokens")
                elif kind == "content_block_delta" and d["delta"].get("type") == "text_delta":
                    if d["delta"].get("text"):
                        if r.ttft_s is None:
                            r.ttft_s = now
                        r.chunk_s.append(now)
                        parts.append(d["delta"]["text"])
                elif kind == "message_delta":  # its usage is the final, cumulative one
                    r.finish_reason = d["delta"].get("stop_reason")
                    u = d.get("usage") or {}
                    r.completion_tokens = u.get("output_tokens", 0)
                    if "cache_read_input_tokens" in u:
                        r.cached_tokens = u["cache_read_input_tokens"]
                        r.prompt_tokens = u.get("input_tokens", 0) + r.cached_tokens
        finally:
            resp.close()
    r.done_s = time.monotonic() - r.sent_at
    r.text = "".join(parts)
    return r


def cpu_by_role(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds (user + system) each process spent between two snapshots; a process
    that appeared, vanished or was replaced is left out."""
    out = {}
    for role, a in after.procs.items():
        b = before.procs.get(role)
        if isinstance(a, str) or isinstance(b, str) or b is None or \
                (a.pid, a.create_time) != (b.pid, b.create_time):
            continue
        out[role] = round(a.user + a.system - b.user - b.system, 3)
    return out
