"""The states and names that cross process boundaries, one closed str enum each. A field
that carries one is typed with it, so common/schema.py decodes it strictly (a value
outside the set is `wrong_type`), and code compares members, never string literals.

Each member's value is its wire string: msgpack and json.dumps write the value, and
`__str__` returns it, so f-strings, `%s` and `str()` show "serving", not
"DeploymentState.SERVING".
"""

from __future__ import annotations

import enum


class _Wire(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class Determinism(_Wire):
    """Whether a rank's forward pass is batch-invariant (services/rank/determinism.py):
    in RANK_READY and DeploymentInfo. `unverified`: the invariant path runs, on an
    architecture the determinism harness does not check."""

    OFF = "off"
    ON = "on"
    UNVERIFIED = "unverified"


class Phase(_Wire):
    """A rank's phase (services/rank/runtime.py owns the transitions): in its marker,
    TELEMETRY, STATS, PONG and DeploymentInfo's RankInfo."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    SERVING = "serving"
    DRAINING = "draining"
    EXITING = "exiting"
    PEER_LOST = "peer_lost"
    LAUNCHER_LOST = "launcher_lost"
    FAILED = "failed"


# Phases from which a rank never serves again: the supervisor counts the rank lost.
DEAD_PHASES = frozenset({Phase.FAILED, Phase.PEER_LOST, Phase.LAUNCHER_LOST})


class DeploymentState(_Wire):
    """A deployment's lifecycle state, in DeploymentInfo.state and Event.state; the
    allowed edges are services/supervisor/deployment_state.py's table."""

    LAUNCHING = "launching"
    LOADING = "loading"
    CANARY = "canary"
    SERVING = "serving"
    ADOPTING = "adopting"  # a restarted supervisor proving a running launch's ranks
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    TEARDOWN_FAILED = "teardown_failed"


# A deployment that ended: its ranks are torn down (or could not be), it serves no more.
TORN_DOWN = frozenset({DeploymentState.STOPPED, DeploymentState.FAILED,
                       DeploymentState.TEARDOWN_FAILED})
# A deployment that failed (a stop is not a failure).
FAILED_STATES = frozenset({DeploymentState.FAILED, DeploymentState.TEARDOWN_FAILED})


class FinishReason(_Wire):
    """How a request's stream ended: its last TOKENS chunk's `finish_reason` (None on
    every other chunk). Sent by rank 0, or by the gateway for a stream it ends itself
    (rank 0 lost, the deployment gone: services/gateway/core/request_stream.py `end_here`).
    The APIs' own renderings ("tool_calls", Anthropic's stop reasons) are the gateway's,
    never wire values."""

    STOP = "stop"  # the model produced a stop token (not emitted)
    LENGTH = "length"  # max_tokens (or the context) reached
    ABORT = "abort"  # removed before its end: a client abort, a cancel, a drain, the watchdog
    ERROR = "error"  # refused or ended by a failure: `error_code` says why


class CancelScope(_Wire):
    """CANCEL's scope: every request of the deployment, or the listed `request_ids`."""

    ALL = "all"
    REQUESTS = "requests"


class Backend(_Wire):
    """The distributed backend a launch uses (DESIGN.md 5.1): `none` for a single rank.
    A deploy may ask for `auto` (the hosts' selection rule picks ring or jaccl)."""

    AUTO = "auto"
    NONE = "none"
    RING = "ring"
    JACCL = "jaccl"
    MPI = "mpi"


class RemoveReason(_Wire):
    """Why a plan removes a request from every rank's batch (PlanRemove.reason; each
    rank's removal records say the same)."""

    ABORT = "abort"  # the requester (a gateway) aborted it
    REQUESTER_GONE = "requester_gone"  # rank 0 could not deliver its tokens any more
    CANCEL = "cancel"  # an epoch-numbered cancel from the supervisor
    WATCHDOG = "watchdog"  # a watchdog aborted everything (services/rank/watchdogs.py)
    SHUTDOWN = "shutdown"  # the final plan of a graceful exit
    PREEMPT = "preempt"  # the KV budget needs its room: rank 0 re-queues it (its stream open)


class ProcState(_Wire):
    """A recorded process as a host agent's probe finds it (services/hostagent)."""

    ALIVE = "alive"  # that process (an empty command line: one on its way out)
    GONE = "gone"  # exited, or a zombie
    REUSED = "reused"  # the pid belongs to a process with another start time
    AMBIGUOUS = "ambiguous"  # same start time, another command line
    UNKNOWN = "unknown"  # not probed (yet), or the probe did not list it


class EventTopic(_Wire):
    """What an EVENT is about."""

    DEPLOYMENT = "deployment"  # a deployment's state or teardown (the supervisor)
    INCIDENT = "incident"  # something failed on a deployment (the supervisor)
    REAP = "reap"  # a reap pass and what it reaped (the reaper)
    REAPER = "reaper"  # the reaper's own counters


class EventName(_Wire):
    """Which event of its topic."""

    STATE = "state"  # deployment: its state changed (Event.state)
    TEARDOWN = "teardown"  # deployment: the teardown after a proven failure ran
    RANK_LOST = "rank_lost"  # incident
    LAUNCH_FAILED = "launch_failed"  # incident
    TEARDOWN_FAILED = "teardown_failed"  # incident
    ADOPTED = "adopted"  # incident: a restarted supervisor adopted a running launch
    ADOPTION_FAILED = "adoption_failed"  # incident: ... could not prove it; torn down
    SUPERVISOR_RESTARTED = "supervisor_restarted"  # incident: `up` restarted its supervisor
    PASS = "pass"  # reap: one pass's summary
    MANIFEST_UNREADABLE = "manifest_unreadable"  # reap
    REAP_FAILED = "reap_failed"  # reap
    REAPED = "reaped"  # reap
    REJECTIONS = "rejections"  # reaper: its rejection counters


class ReapOutcome(_Wire):
    """A reap event's outcome (topic `reap`, Event.outcome)."""

    OK = "ok"  # a pass that blocks no launch
    BLOCKED = "blocked"  # a pass (or an unreadable manifest) that blocks launches
    FAILED = "failed"  # a job's ranks could not be proven gone
    REAPED = "reaped"  # a job's ranks are gone, its manifest removed


class Speculation(str, enum.Enum):
    """How rank 0 proposes drafts for its decode rows to verify (services/rank/spec_step.py):
    not at all, or by prompt lookup (services/rank/ngram_drafts.py)."""

    OFF = "off"
    NGRAM = "ngram"
