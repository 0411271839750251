"""Admin and events channels (cluster key): ADMIN_REQUEST → ADMIN_REPLY on admin,
EVENT on events. The gateway, the admin CLI and `lockstep up` talk to the supervisor
over them; the reply's `code` is typed (AdminCode), its `message` is for people.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.messages.base import TEXT
from common.messages.vocab import DeploymentState, EventName, EventTopic, ReapOutcome


@dataclass
class AdminRequest:
    request_id: str
    command: str
    args: dict[str, object] = field(default_factory=dict)


class AdminCode(str, enum.Enum):
    """How an admin command ended, typed: `ok`, or why not (the message is for people).
    A closed set: a value outside it fails the schema. The gateway maps each failure to
    an HTTP status in one table (services/gateway/core/errors.py ADMIN_STATUS)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    UNKNOWN_COMMAND = "unknown_command"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    ACTIVE_REQUESTS = "active_requests"
    LAUNCH_FAILED = "launch_failed"
    TEARDOWN_FAILED = "teardown_failed"
    REAP_BLOCKED = "reap_blocked"
    SIGNATURE_MISMATCH = "signature_mismatch"
    TIMEOUT = "timeout"  # the ranks did not confirm in time (e.g. a cache clear)
    INTERNAL = "internal"

    def __str__(self) -> str:  # the wire string, in logs, metric labels and f-strings
        return self.value


@dataclass
class AdminReply:
    request_id: str
    ok: bool
    code: AdminCode
    message: str = field(default="", metadata=TEXT)
    data: dict[str, object] = field(default_factory=dict)


@dataclass
class Event:
    topic: EventTopic
    name: EventName
    deployment_id: str
    state: DeploymentState | None  # topics deployment and incident: the deployment's state
    reason: str = field(default="", metadata=TEXT)
    at: float = 0.0
    data: dict[str, object] = field(default_factory=dict)
    outcome: ReapOutcome | None = None  # topic reap
