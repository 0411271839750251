"""The real agent clients, as users run them against a Lockstep gateway: Claude Code
(`claude -p`, over /v1/messages) and Codex (`codex exec`, over /v1/responses), installed
pinned from the npm registry by `make agent-clients` (part of `make test`) into
.venv/agent-clients. Each run gets its own HOME, so nothing of the user's is read or
written, and the clients' non-essential traffic (telemetry, update checks) is off."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.support.processes import REPO

BIN = REPO / ".venv" / "agent-clients" / "node_modules" / ".bin"
CLAUDE, CODEX = BIN / "claude", BIN / "codex"
# Codex's multi-agent namespace and goal tools (3.5k tokens) off: for a small context.
CODEX_SMALL_CONTEXT = ("--disable", "multi_agent", "--disable", "goals")
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def missing() -> str | None:
    """Why the clients cannot run here (None: they can); a test fails with it."""
    for b in (CLAUDE, CODEX):
        if not os.access(b, os.X_OK):
            return f"{b} is missing: run `make agent-clients` (npm install, pinned versions)"
    return None


def claude(url: str, model: str, prompt: str, home: Path, *args: str,
           timeout: float = 300, max_output: int = 256) -> dict:
    """`claude -p PROMPT --output-format json` against `url`; its JSON result."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **QUIET, "HOME": str(home), "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_API_KEY": "lockstep-test", "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output)}
    p = subprocess.run([str(CLAUDE), "-p", prompt, "--model", model, "--output-format", "json",
                        *args], env=env, cwd=home, capture_output=True, text=True,
                       timeout=timeout)
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"claude exited {p.returncode}: {p.stdout[-2000:]}"
                             f"{p.stderr[-2000:]}") from None


def codex(url: str, model: str, prompt: str, home: Path, *args: str, resume: bool = False,
          timeout: float = 300) -> dict:
    """`codex exec --json PROMPT` against `url` over /v1/responses (`resume`: `codex exec
    resume --last`, the session before continued), with web search off: a hosted tool
    Lockstep cannot run (its 400 says so). Returns the exit code, the agent's last
    message, the turn's usage and every JSON event."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home),
           "OPENAI_API_KEY": "lockstep-test"}
    provider = ('model_providers.lockstep={name="lockstep",base_url="' + url
                + '/v1",wire_api="responses"}')
    argv = [str(CODEX), "exec", *(["resume", "--last"] if resume else []),
            "--skip-git-repo-check", "--json", "-c", "model_provider=lockstep", "-c", provider,
            "-c", "web_search=disabled", "-c", "analytics.enabled=false",
            "-c", "check_for_update_on_startup=false", "-m", model, *args, prompt]
    p = subprocess.run(argv, env=env, cwd=home, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout)
    events = []
    for line in p.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # Codex's own notices between the events
    messages = [e["item"].get("text", "") for e in events if e.get("type") == "item.completed"
                and e.get("item", {}).get("type") == "agent_message"]
    usage = next((e.get("usage") for e in reversed(events)
                  if e.get("type") == "turn.completed"), None)
    return {"returncode": p.returncode, "message": messages[-1] if messages else None,
            "usage": usage, "events": events, "stderr": p.stderr[-3000:]}
