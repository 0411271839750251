"""A deployment's lifecycle: the enum (common/messages/vocab.py DeploymentState, the
type of DeploymentInfo.state and Event.state), one table of the allowed edges, and the one
owner of the transitions and of the claim that a launch, stop or teardown holds on it.

    launching -> loading -> canary -> serving            (deploy: lifecycle.start/_launch)
    launching | loading | canary -> failed | teardown_failed    (a launch that failed)
    serving -> failed                                    (the monitor: a rank was lost)
    failed -> teardown_failed                            (after_failure gave up)
    serving | failed | teardown_failed -> stopping       (a stop; teardown_failed: a retry)
    stopping -> stopped | teardown_failed                (the stop's verified teardown)
    failed -> stopped                                    (a stop during its launch)
    adopting -> serving | failed | teardown_failed       (a restarted supervisor: adoption)

`stopped` is terminal (the deployment has left the table); `teardown_failed` is left
only by a stop. A launch, stop or post-failure teardown holds the deployment's one claim
(`StateMachine.claim`) while it runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from common.messages.vocab import DeploymentState

S = DeploymentState
ALLOWED: dict[DeploymentState, frozenset[DeploymentState]] = {
    S.LAUNCHING: frozenset({S.LOADING, S.FAILED, S.TEARDOWN_FAILED}),
    S.LOADING: frozenset({S.CANARY, S.FAILED, S.TEARDOWN_FAILED}),
    S.CANARY: frozenset({S.SERVING, S.FAILED, S.TEARDOWN_FAILED}),
    S.SERVING: frozenset({S.FAILED, S.STOPPING}),
    S.ADOPTING: frozenset({S.SERVING, S.FAILED, S.TEARDOWN_FAILED}),
    S.FAILED: frozenset({S.TEARDOWN_FAILED, S.STOPPING, S.STOPPED}),
    S.TEARDOWN_FAILED: frozenset({S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED, S.TEARDOWN_FAILED}),
    S.STOPPED: frozenset(),
}
# Ranks may be running: leases are renewed, abort-all reaches it, a stop tears it down.
LIVE = frozenset({S.LAUNCHING, S.LOADING, S.CANARY, S.SERVING, S.STOPPING, S.ADOPTING})
STARTING = frozenset({S.LAUNCHING, S.LOADING, S.ADOPTING})  # leases renewed fast: ranks wait for one


class Claim(str, Enum):
    """Who holds a deployment: one at a time; the others are refused or wait."""

    LAUNCH = "launch"
    STOP = "stop"
    AFTER_FAILURE = "teardown after failure"
    ADOPT = "adoption"


class IllegalTransition(RuntimeError):
    """An edge the table does not allow: a bug in the caller, never an operator's error."""

    def __init__(self, deployment_id: str, frm: DeploymentState, to: DeploymentState) -> None:
        super().__init__(f"deployment {deployment_id}: {frm.value} -> {to.value} is not an "
                         f"allowed transition (from {frm.value}: "
                         f"{', '.join(sorted(s.value for s in ALLOWED[frm])) or 'none'})")
        self.deployment_id, self.frm, self.to = deployment_id, frm, to


@dataclass(frozen=True)
class Transition:
    frm: DeploymentState
    to: DeploymentState
    reason: str
    at: float  # wall time


@dataclass
class StateMachine:
    deployment_id: str
    state: DeploymentState = DeploymentState.LAUNCHING
    history: list[Transition] = field(default_factory=list)
    holder: Claim | None = None  # the one lock: a launch, stop or teardown running on it

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def claim(self, holder: Claim) -> bool:
        """Take the deployment for `holder`; False if someone holds it already. (Single
        event loop: no await between the check and the take.)"""
        if self.holder is not None:
            return False
        self.holder = holder
        return True

    def release(self) -> None:
        self.holder = None

    def transition(self, to: DeploymentState | str, reason: str = "") -> bool:
        """Move to `to` (raises IllegalTransition on an edge the table lacks); False, and
        nothing recorded, if already there."""
        to = DeploymentState(to)
        if to is self.state:
            return False
        if to not in ALLOWED[self.state]:
            raise IllegalTransition(self.deployment_id, self.state, to)
        self.history.append(Transition(self.state, to, reason, time.time()))
        self.state = to
        return True
