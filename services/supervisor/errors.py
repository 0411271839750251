"""Supervisor errors. Every admin failure carries one stable code (the gateway maps
codes to HTTP statuses; `signature_mismatch` is 409)."""

from __future__ import annotations

from typing import Any

from common.messages import AdminCode

CODES = frozenset(c.value for c in AdminCode if c is not AdminCode.OK)


class AdminError(Exception):
    """A command failed; `code` is stable, `message` says what to do, `data` is evidence."""

    def __init__(self, code: AdminCode | str, message: str,
                 data: dict[str, Any] | None = None) -> None:
        self.code = AdminCode(code)  # a code outside the closed set is a bug: ValueError
        if self.code is AdminCode.OK:
            raise ValueError("an AdminError cannot be ok")
        super().__init__(f"{self.code}: {message}")
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
