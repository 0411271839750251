"""`lockstep up`'s progress while a deployment starts: one line per stage (launching,
loading with each rank's weights read / total, canary, ready).

On a terminal the current stage's line is redrawn in place (`\\r`, erase line) and ends
when the stage changes; otherwise (a pipe, a log) a plain line is written only when the
text changes, load percentages rounded down to a quarter so a slow load prints a few
lines, not hundreds. Every finished stage's last line also goes to up.log.
"""

from __future__ import annotations

from common.deployment_info import DeploymentInfo
from common.messages import DeploymentState, Phase

ERASE = "\r\x1b[K"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def stage_line(dep: DeploymentInfo, *, coarse: bool) -> tuple[str, str]:
    """(stage, text) for one DeploymentInfo. `coarse`: load percentages in quarters."""
    S, state = DeploymentState, dep.state
    if state == S.LOADING:
        parts = []
        for r in dep.ranks:
            ld = r.load
            if r.phase == Phase.LOADING and ld is not None and ld.total_bytes:
                pct = 100 * min(ld.read_bytes, ld.total_bytes) // ld.total_bytes
                pct = pct // 25 * 25 if coarse else pct
                parts.append(f"rank {r.rank} {pct}%" + ("" if coarse else
                             f" ({_mib(ld.read_bytes)}/{_mib(ld.total_bytes)})"))
            else:
                parts.append(f"rank {r.rank} {r.phase}")
        return state.value, "loading weights: " + (", ".join(parts) or "ranks starting")
    if state == S.LAUNCHING:
        return state.value, f"launching {dep.world_size} rank(s) (backend {dep.backend})"
    if state == S.CANARY:
        return state.value, "canary: greedy generations compared across runs"
    if state == S.SERVING:
        return state.value, "canary passed: serving; waiting for the gateway's /ready"
    return state.value, f"deployment {state}" + (f": {dep.error}" if dep.error else "")


class UpProgress:
    def __init__(self, console, tty: bool) -> None:
        self.console = console  # services.up.console.UpConsole
        self.tty = tty
        self.stage: str | None = None
        self.text: str | None = None
        self.open = False  # a redrawn line is on the terminal, without its newline

    def update(self, dep: DeploymentInfo | None) -> None:
        if dep is None:
            return
        stage, text = stage_line(dep, coarse=not self.tty)
        if stage == self.stage and text == self.text:
            return
        if stage != self.stage:
            self.end()
        self.stage, self.text = stage, text
        if self.tty:
            self.console.redraw(ERASE + f"lockstep up: {text}")
            self.open = True
        else:
            self.console.say(f"lockstep up: {text}")

    def end(self) -> None:
        """Close the current stage's line (on a terminal: its newline, and the log)."""
        if self.open and self.text is not None:
            self.console.redraw("\n")
            self.console.log_only(f"lockstep up: {self.text}")
        self.open = False
