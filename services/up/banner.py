"""The banner `lockstep up` prints once its deployment serves: where to send requests,
the deployment's defaults, what happens when something dies, and a request to try."""

from __future__ import annotations

import json
import os
from typing import Protocol

from common.home import Paths
from common.messages.commands.status_text import determinism_text, speculation_text
from services.up.console import UpConsole
from services.up.settings import UpSettings


class Up(Protocol):
    """What the banner reads of `lockstep up` (services/up/run.py's Up): declared here,
    so this module needs nothing above it."""

    s: UpSettings  # type: ignore[valid-type]
    paths: Paths
    console: UpConsole
    admin_token: str

    def log(self, msg: str, *, err: bool = False) -> None: ...


def print_banner(up: Up, url: str, model: str, dep_id: str, dep) -> None:
    body = json.dumps({"model": model, "max_tokens": 32,
                       "messages": [{"role": "user", "content":
                                     "What is the capital of France?"}]})
    auth = " -H 'Authorization: Bearer $KEY'" if os.environ.get("LOCKSTEP_API_KEYS") else ""
    up.console.say(
        f"\nlockstep is serving {model} ({dep_id}, tp={up.s.tp}, pp={up.s.pp}) at {url}\n"
        f"  OpenAI base URL: {url}/v1    ready: {url}/ready    metrics: {url}/metrics\n"
        f"  admin token:     {up.paths.admin_token}\n"
        f"  sampling defaults (a request's own values win): "
        f"{dep.sampling.describe() if dep is not None else '?'}\n"
        f"  deterministic:   "
        f"{determinism_text(dep.determinism) if dep is not None else '?'}\n"
        f"  speculative:     "
        f"{speculation_text(dep.speculation) if dep is not None else '?'}\n"
        f"  KV budget:       {kv_budget_text(dep)}\n"
        f"  recovery:        {recovery_text(up.s)}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"       -d '{body}'\n")
    # The console's login link carries the token in its fragment (never sent to a
    # server): to the terminal only, not to up.log.
    up.console.redraw(f"  cluster console: {url}/admin/#token={up.admin_token}\n\n")
    up.console.say("Press Ctrl-C to stop.\n")


def kv_budget_text(dep) -> str:
    """The banner's line on the KV budget, as rank 0 enforces it (services/rank/kv_budget.py)."""
    kv = None if dep is None else next((r.kv for r in dep.ranks if r.rank == 0), None)
    if kv is None:
        return "?"
    if not kv.budget:
        return "off (--kv-budget-bytes 0): running requests' KV is not bounded"
    if not kv.slot_bytes:
        return f"{kv.budget} bytes per rank, NOT enforced (this model's cache is not a plain KV cache)"
    return (f"{kv.budget / 2**20:.1f} MiB per rank ({kv.budget // kv.slot_bytes} token slots "
            "of KV): requests wait until theirs fits")


def recovery_text(s: UpSettings) -> str:
    """The banner's line on what `up` does when something dies (--restarts etc.)."""
    sup = (f"supervisor restarted at most {s.supervisor_restarts} within the window, ranks "
           f"wait {s.adopt_window:g}s to be adopted" if s.supervisor_restarts
           else "supervisor not restarted (--supervisor-restarts 0)")
    return (f"redeploys at most {s.restarts} within {s.restart_window:g}s "
            f"(backoff from {s.restart_backoff:g}s); {sup}")
