"""The launch spec a supervisor hands to each rank (a 0600 JSON file, no secrets).

The launch secret travels in its own 0600 file (`secret_path`), never in argv or the
environment. `settings` are identical for every rank of a launch: BatchGenerator
arguments must match on all ranks or their step schedules diverge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic_json import read_json, write_json_atomic
from common.config import (
    AtLeastOne,
    Count,
    PositiveSeconds,
    Seconds,
    StallRatio,
    check,
    env_name,
    load_settings,
)
from common.messages.vocab import Backend, Speculation
from common.schema import decode_into, to_wire

SCHEMA_VERSION = 1

# Settings a rank's own environment may set over its spec (DESIGN 7), by the one parser
# (common.config): `LOCKSTEP_<NAME>` of the same field. The supervisor strips them from
# what ranks inherit, so its own resolved settings win; a deployment's explicit envs may
# still set them.
ENV_OVERRIDES = ("peer_abort_grace", "progress_stall_timeout", "signal_clear_timeout")
WATCHDOG_ENV = tuple(env_name(n) for n in ENV_OVERRIDES)


def speculation_problem(speculative: Speculation, deterministic: bool) -> str | None:
    """Why these settings cannot go together (None: they can): a verify step's tokens are
    plain decoding's only when the forward pass is batch-invariant."""
    if speculative is not Speculation.OFF and not deterministic:
        return (f"--speculative {speculative.value} needs --deterministic: verifying drafts "
                "emits plain decoding's tokens only with the batch-invariant forward pass")
    return None


DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # a rank given 0: one fixed number on every rank
OPEN_REQUESTS_PER_SLOT = 8  # rank 0's default bound: 8 x max_batch open requests
PROMPT_CACHE_AUTO_MAX = 4 << 30  # prompt_cache_bytes=0 (auto): at most 4 GiB per rank
PROMPT_CACHE_AUTO_SHARE = 8  # ... and at most 1/8 of the supervisor host's memory


PROMPT_CACHE_DISK_AUTO_MAX = 64 << 30  # prompt_cache_disk_bytes=-1 (auto): at most 64 GiB
PROMPT_CACHE_DISK_AUTO_SHARE = 10  # ... and at most a tenth of the free disk


def auto_prompt_cache_disk_bytes(free_disk: int) -> int:
    """The disk tier's byte budget per rank `prompt_cache_disk_bytes=-1` (auto) stands
    for, from the free bytes of the supervisor's home's filesystem (resolved once there)."""
    return min(PROMPT_CACHE_DISK_AUTO_MAX, free_disk // PROMPT_CACHE_DISK_AUTO_SHARE)


KV_AUTO_SHARE = 0.9  # kv_budget_bytes=-1 (auto): of the host's memory, the rest headroom


class KvBudgetRefused(ValueError):
    """An auto KV budget of nothing: the deployment cannot run a request (the numbers)."""


def auto_kv_budget_bytes(host_memory: int, weights: int, world_size: int,
                         prompt_cache_bytes: int) -> int:
    """The KV budget per rank `kv_budget_bytes=-1` (auto) stands for: 90 % of the
    supervisor host's memory less the model's weights, shared by the deployment's ranks
    (as if all ran on that host: the safe side for several hosts), less each rank's
    prompt-cache budget. Raises KvBudgetRefused, with the numbers, if that is <= 0."""
    usable = int(host_memory * KV_AUTO_SHARE)
    budget = (usable - weights) // max(1, world_size) - prompt_cache_bytes
    if budget <= 0:
        raise KvBudgetRefused(
            f"no memory is left for KV: 90% of this host's {host_memory} bytes ({usable}) "
            f"less the weights' {weights} bytes, over {world_size} rank(s), less "
            f"{prompt_cache_bytes} bytes of prompt cache per rank is {budget} bytes per "
            "rank; set --kv-budget-bytes (or use more hosts, a smaller prompt cache)")
    return budget


def auto_prompt_cache_bytes(host_memory: int) -> int:
    """The byte budget `prompt_cache_bytes=0` (auto) stands for, from the physical memory
    of the supervisor's host: resolved once there, so every rank gets the same number."""
    return min(PROMPT_CACHE_AUTO_MAX, host_memory // PROMPT_CACHE_AUTO_SHARE)


@dataclass
class RankSettings:
    """A field the supervisor sets has the name of its SupervisorSettings field (and so
    of its flag and variable): `rank_settings()` in services/supervisor/job_launch.py copies
    them by name."""

    max_batch: AtLeastOne = 16  # completion_batch_size
    # Rank 0 refuses a GENERATE (error_code overloaded) while this many requests are
    # open, running or waiting; 0 = OPEN_REQUESTS_PER_SLOT x max_batch.
    max_open_requests: Count = 0
    prefill_batch: AtLeastOne = 8
    prefill_step: AtLeastOne = 512  # prompt tokens per chunk while no stream is decoding
    # While streams decode, every step runs one decode and one prompt chunk: of
    # prefill_step_decoding tokens (throughput), or, while a prompt of more than
    # prefill_long_prompt tokens prefills (0: any prompt), sized by rank 0 so the step
    # takes about prefill_stall_ratio times a decode-only step at most (more while more
    # prompts wait than streams run; 0 ratio: never; services/rank/prefill_policy.py).
    prefill_stall_ratio: StallRatio = 3.0
    prefill_step_decoding: AtLeastOne = 512
    prefill_long_prompt: Count = 2048
    # Prefix cache (services/rank/prefix_cache.py): stored entries at most; 0 = off.
    prompt_cache_entries: Count = 32
    # Stored KV bytes per rank at most; 0 here = DEFAULT_PROMPT_CACHE_BYTES (the
    # supervisor resolves its own 0, "auto", from memory before any rank sees it).
    prompt_cache_bytes: Count = 0
    # The disk tier (services/rank/disk_tier.py): KV bytes per rank on its own disk under
    # $LOCKSTEP_HOME/kvcache; 0 = off (the supervisor resolves its -1, "auto").
    prompt_cache_disk_bytes: Count = 0
    # KV bytes per rank for running requests (services/rank/kv_budget.py), enforced by
    # rank 0's admission; 0 = no budget (the supervisor resolves its -1, "auto").
    kv_budget_bytes: Count = 0
    rank_telemetry_interval_s: PositiveSeconds = 1.0
    plan_fetch_after_s: PositiveSeconds = 0.25  # follower asks for missed plans after this
    replay_buffer: AtLeastOne = 1024  # plans rank 0 keeps for followers that missed some
    lease_ttl: Seconds = 45.0  # no LEASE for this long (after one): launcher_lost; 0: off
    # A local rank whose parent (the supervisor) died keeps serving this long for a
    # restarted supervisor to adopt it (a lease after its re-authentication); 0: the
    # parent gone is launcher_lost at once (services/rank/watchdogs.py).
    adopt_window_s: Seconds = 0.0
    peer_probe_interval_s: PositiveSeconds = 0.5
    peer_probe_interval_loading_s: PositiveSeconds = 2.0
    peer_fail_tolerance: AtLeastOne = 2
    peer_abort_grace: Seconds = 5.0
    progress_stall_timeout: Seconds = 120.0
    signal_clear_timeout: Seconds = 10.0
    openblas: bool = True
    # The batch-invariant forward pass (services/rank/determinism.py): a request's tokens
    # and logprobs depend on it alone, not on its batch, prefill chunk or cache start.
    deterministic: bool = True
    # Rank 0 proposes drafts its decode rows verify in one step (services/rank/spec_step.py):
    # a request's tokens stay plain decoding's; needs `deterministic`.
    speculative: Speculation = Speculation.OFF
    auth_timeout_s: PositiveSeconds = 30.0  # no mutual authentication by then: fail
    rank_test_seams: bool = False  # allows LOCKSTEP_TEST_* fault switches (tests only)

    def with_env(self, env: Mapping[str, str]) -> RankSettings:
        """These settings, the ENV_OVERRIDES in `env` over them, every range checked
        (common.config.ConfigError names the variable)."""
        return load_settings(RankSettings, env=env, base=check(self), only=ENV_OVERRIDES)

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
    backend: Backend  # ring | jaccl | mpi | none (single rank)
    home: str
    secret_path: str
    control_endpoint: str  # supervisor control PUB (ranks connect SUB)
    report_endpoint: str  # supervisor report ROUTER (ranks connect DEALER)
    plan_endpoint: str  # rank 0 plan ROUTER: rank 0 binds it, followers connect
    requests_endpoint: str  # rank 0 requests ROUTER: rank 0 binds it, gateway connects
    supervisor_pid: int
    cancel_epoch_floor: int = 0  # epochs at or below are a watermark, never replayed
    hostfile: str = ""
    # The disk prefix cache's key (hex, 0600, in the job dir); "" = no disk tier.
    cache_key_path: str = ""
    replica: int = 0  # which replica of its model this launch is (the disk tier's placement)
    # Local ranks are the supervisor's children: re-parenting means it is gone. A remote
    # rank's parent is the short-lived host agent, so only the lease can watch for it.
    watch_parent: bool = True
    settings: RankSettings = field(default_factory=RankSettings)

    def save(self, path: Path) -> None:
        write_json_atomic(path, to_wire(self))

    @classmethod
    def load(cls, path: Path) -> RankSpec:
        return decode_into(cls, read_json(path))

