"""The launch spec a supervisor hands to each rank (a 0600 JSON file, no secrets).

The launch secret travels in its own 0600 file (`secret_path`), never in argv or the
environment. `settings` are identical for every rank of a launch: BatchGenerator
arguments must match on all ranks or their step schedules diverge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.schema import decode_into, to_wire
from common.statefiles import read_json, write_json_atomic

SCHEMA_VERSION = 1

# Environment variables a rank reads on top of its spec's settings (rank side:
# services/rank/watchdogs.py). The supervisor strips them from what ranks inherit, so its
# own resolved settings win; a deployment's explicit envs may still set them.
WATCHDOG_ENV = {
    "LOCKSTEP_PEER_ABORT_GRACE": "abort_grace_s",
    "LOCKSTEP_PROGRESS_STALL_TIMEOUT": "progress_stall_s",
    "LOCKSTEP_SIGNAL_CLEAR_TIMEOUT": "signal_clear_timeout_s",
}


OPEN_REQUESTS_PER_SLOT = 8  # rank 0's default bound: 8 x max_batch open requests


@dataclass
class RankSettings:
    max_batch: int = 16  # completion_batch_size
    # Rank 0 refuses a GENERATE (error_code overloaded) while this many requests are
    # open, running or waiting; 0 = OPEN_REQUESTS_PER_SLOT x max_batch.
    max_open_requests: int = 0
    prefill_batch: int = 8
    prefill_step: int = 512
    default_max_tokens: int = 256
    telemetry_interval_s: float = 1.0
    plan_fetch_after_s: float = 0.25  # follower asks for missed plans after this silence
    replay_buffer: int = 1024  # plans rank 0 keeps for followers that missed some
    lease_stale_s: float = 45.0
    peer_probe_interval_s: float = 0.5
    peer_probe_interval_loading_s: float = 2.0
    peer_fail_tolerance: int = 2
    peer_abort_grace_s: float = 5.0
    progress_stall_s: float = 120.0
    signal_clear_timeout_s: float = 10.0
    openblas: bool = True
    auth_timeout_s: float = 30.0  # no mutual authentication with the supervisor by then: fail
    test_seams: bool = False  # allows LOCKSTEP_TEST_* fault switches (tests only)

    def open_requests_bound(self) -> int:
        if self.max_open_requests > 0:
            return self.max_open_requests
        return OPEN_REQUESTS_PER_SLOT * self.max_batch


@dataclass
class RankSpec:
    schema_version: int
    deployment_id: str
    job_id: str
    rank: int
    world_size: int
    tp: int
    pp: int
    host: str
    model_path: str
    backend: str  # ring | jaccl | mpi | none (single rank)
    home: str
    secret_path: str
    control_endpoint: str  # supervisor control PUB (ranks connect SUB)
    report_endpoint: str  # supervisor report ROUTER (ranks connect DEALER)
    plan_endpoint: str  # rank 0 plan ROUTER: rank 0 binds it, followers connect
    requests_endpoint: str  # rank 0 requests ROUTER: rank 0 binds it, gateway connects
    supervisor_pid: int
    cancel_epoch_floor: int = 0  # epochs at or below are a watermark, never replayed
    hostfile: str = ""
    # Local ranks are the supervisor's children: re-parenting means it is gone. A remote
    # rank's parent is the short-lived host agent, so only the lease can watch for it.
    watch_parent: bool = True
    settings: RankSettings = field(default_factory=RankSettings)

    def save(self, path: Path) -> None:
        write_json_atomic(path, to_wire(self))

    @classmethod
    def load(cls, path: Path) -> RankSpec:
        return decode_into(cls, read_json(path))

