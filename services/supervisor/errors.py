"""Supervisor errors. Every admin failure carries one stable code (the gateway maps
codes to HTTP statuses; `signature_mismatch` is 409)."""

from __future__ import annotations

from typing import Any

CODES = frozenset({
    "bad_request", "unknown_command", "not_found", "conflict", "active_requests",
    "launch_failed", "teardown_failed", "reap_blocked", "signature_mismatch",
    "internal",
})


class AdminError(Exception):
    """A command failed; `code` is stable, `message` says what to do, `data` is evidence."""

    def __init__(self, code: str, message: str, data: dict[str, Any] | None = None) -> None:
        assert code in CODES, code
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = data or {}


def survivor_text(s: dict[str, Any]) -> str:
    """'rank 1 pid 4242', plus where and why for a rank on a remote host."""
    text = f"rank {s.get('rank', '?')} pid {s.get('pid')}"
    if s.get("ssh"):
        text += f" on {s.get('host') or s['ssh']} ({s.get('reason') or 'not proven'})"
    return text


class TeardownError(Exception):
    """Exit of some rank processes could not be proven; names each survivor."""

    def __init__(self, deployment_id: str, survivors: list[dict[str, Any]],
                 outcome: dict[str, Any]) -> None:
        names = ", ".join(survivor_text(s) for s in survivors)
        super().__init__(f"teardown of {deployment_id} not proven: still alive: {names}")
        self.deployment_id = deployment_id
        self.survivors = survivors
        self.outcome = outcome


class LaunchError(Exception):
    """A launch failed; `teardown` is set when cleaning up after it failed too."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.teardown: TeardownError | None = None
