"""After a rank is lost while serving (the monitor's `rank_lost`): tear down what is left
of the deployment on every host, without anyone asking, and keep at it while a host
cannot be reached, since a partition usually heals.

Each attempt is a verified teardown (lifecycle.teardown) under its own deadline
(`attempt_deadline`: the steps' timeouts plus ssh connects and some slack), so neither a
stalled ssh nor anything else can hold it, or a stop waiting for it, for longer. An attempt
that is not proven (a host unreachable, ssh timed out) is recorded in the manifest and
retried every RETRY_S, while the state stays `failed`, until it is proven or
`retry_window` has passed; then the state is `teardown_failed` (manifest and evidence
kept, a stop retries). An attempt that raises anything else is logged with its
traceback and counts as not proven. Every attempt is logged when it starts and ends:
a `failed` deployment always shows what is being done about it.

A stop arriving meanwhile waits for this (lifecycle.stop), so `lockstep up`'s stop-then-
redeploy finds the ranks already proven gone once the link is back; a supervisor that
is closing sets `dep.abort_reason` and the retries end after the attempt in progress.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from common.messages import EventName, EventTopic
from services.supervisor import lifecycle
from services.supervisor.deployment import Deployment
from services.supervisor.deployment_state import Claim, DeploymentState
from services.supervisor.errors import TeardownError
from services.supervisor.settings import SupervisorSettings

if TYPE_CHECKING:
    from services.supervisor.interfaces import TeardownHost

log = logging.getLogger("lockstep.supervisor")
GRACEFUL_S = 1.0  # the lost rank's peers are usually gone already: don't wait long
RETRY_S = 2.0
MIN_ATTEMPTS = 2  # one more on fresh connections even when the first used up the window
SSH_SLACK_S = 10.0  # the attempt's ssh round trips (well under a second each on a LAN)


def attempt_deadline(s: SupervisorSettings) -> float:
    """The longest one attempt may take: its waits, two ssh connects that time out, and
    SSH_SLACK_S. Not each ssh's own deadline (ssh_command_timeout, generous): an ssh
    that hangs on a half-open connection just after the link came back would hold the
    attempt that long; cut short, the next attempt starts on fresh connections."""
    return (GRACEFUL_S + s.stop_timeout + 2 * s.kill_timeout + 2 * s.ssh_connect_timeout
            + SSH_SLACK_S)


def retry_window(s: SupervisorSettings) -> float:
    """How long new attempts start after the first (at least MIN_ATTEMPTS are made): the
    ranks on a cut-off host leave on their own by then (lease_ttl); a longer partition
    needs an operator's stop."""
    return s.lease_ttl + RETRY_S


async def teardown_after_failure(sup: TeardownHost, dep: Deployment, reason: str) -> None:
    if not dep.life.claim(Claim.AFTER_FAILURE):  # a stop or launch is tearing it down
        log.warning("deployment %s: no teardown after the failure: busy (%s)",
                    dep.deployment_id, dep.state)
        return
    try:
        await _attempts(sup, dep)
    finally:
        dep.life.release()


async def _attempts(sup: TeardownHost, dep: Deployment) -> None:
    s = sup.settings
    deadline = attempt_deadline(s)
    give_up_at = time.monotonic() + retry_window(s)
    attempt = 0
    while True:
        attempt += 1
        t0 = time.monotonic()
        log.info("deployment %s: teardown after the failure, attempt %d (deadline %.0fs)",
                 dep.deployment_id, attempt, deadline)
        why = await _attempt(sup, dep, deadline)
        took = time.monotonic() - t0
        if why is None:
            log.info("deployment %s: teardown after the failure proven in %.1fs (attempt %d, "
                     "path %s)", dep.deployment_id, took, attempt,
                     " -> ".join((dep.teardown or {}).get("path") or []) or "none alive")
            sup.emit(EventTopic.DEPLOYMENT, EventName.TEARDOWN, dep, "teardown after the failure proven",
                     {"outcome": dep.teardown or {}, "attempts": attempt})  # its ladder path
            return
        late = attempt >= MIN_ATTEMPTS and time.monotonic() + RETRY_S >= give_up_at
        if dep.abort_reason is not None or late:
            sup.set_state(dep, DeploymentState.TEARDOWN_FAILED, why)
            sup.incident(dep, EventName.TEARDOWN_FAILED, why, {"outcome": dep.teardown or {},
                                                        "attempts": attempt})
            return
        log.warning("deployment %s: teardown after the failure not proven (attempt %d, "
                    "%.1fs): %s; retrying in %gs", dep.deployment_id, attempt, took, why,
                    RETRY_S)
        await asyncio.sleep(RETRY_S)


async def _attempt(sup: TeardownHost, dep: Deployment, deadline: float) -> str | None:
    """One bounded teardown: None if proven, else why not."""
    try:
        await asyncio.wait_for(lifecycle.teardown(sup, dep, graceful_s=GRACEFUL_S, final=False),
                               deadline)
    except TeardownError as exc:
        return str(exc)
    except asyncio.TimeoutError:
        why = f"teardown of {dep.deployment_id} did not finish within {deadline:.0f}s"
    except Exception as exc:  # noqa: BLE001 - logged in full; the state must move on
        log.exception("deployment %s: teardown after the failure raised", dep.deployment_id)
        why = f"teardown of {dep.deployment_id} raised {type(exc).__name__}: {exc}"
    else:
        return None
    lifecycle.record_unproven(sup, dep, why)  # (a TeardownError was recorded by lifecycle.teardown)
    return why
