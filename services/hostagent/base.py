"""What every host-agent command shares: the error it answers with, identities as JSON,
signal names, bounded stdin."""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

from common.procs import ProcessIdentity

MAX_STDIN_BYTES = 16 * 1024 * 1024


class AgentError(Exception):
    """A failure reported as {"error": ...} with exit status 1."""


def identity_to_dict(ident: ProcessIdentity) -> dict[str, Any]:
    return {"pid": ident.pid, "start_time": ident.start_time, "cmdline": list(ident.cmdline)}


def identity_from_dict(d: Any, where: str = "identity") -> ProcessIdentity:
    # "pgid" is allowed, so that what `spawn` prints can be passed back as it is.
    if type(d) is not dict or set(d) - {"pid", "start_time", "cmdline", "pgid"}:
        raise AgentError(f"{where}: expected an object with pid, start_time, cmdline")
    pid, start, cmdline = d.get("pid"), d.get("start_time"), d.get("cmdline")
    if type(pid) is not int or pid < 1:
        raise AgentError(f"{where}.pid: expected an int >= 1, got {pid!r}")
    if type(start) not in (int, float):
        raise AgentError(f"{where}.start_time: expected a number, got {start!r}")
    if type(cmdline) is not list or not all(type(a) is str for a in cmdline):
        raise AgentError(f"{where}.cmdline: expected a list of strings")
    return ProcessIdentity(pid, float(start), tuple(cmdline))


def json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise AgentError(f"{what}: not valid JSON: {e}") from None


def identities_arg(text: str, what: str) -> list[ProcessIdentity]:
    raw = json_arg(text, what)
    if type(raw) is not list:
        raise AgentError(f"{what}: expected a JSON list of identities")
    return [identity_from_dict(d, f"{what}[{i}]") for i, d in enumerate(raw)]


def parse_signal(text: str) -> int:
    """TERM, SIGTERM, sigterm or 15 → 15. Signal 0 (probe) is not a signal here."""
    if text.isdigit():
        num = int(text)
        valid = {int(s) for s in signal.valid_signals()}
        if num not in valid or num == 0:
            raise AgentError(f"unknown signal {text!r}")
        return num
    name = text.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    sig = getattr(signal.Signals, name, None) if name.isidentifier() else None
    if sig is None:
        raise AgentError(f"unknown signal {text!r}")
    return int(sig)


def read_stdin() -> bytes:
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    if len(data) > MAX_STDIN_BYTES:
        raise AgentError(f"stdin is larger than {MAX_STDIN_BYTES} bytes")
    return data
