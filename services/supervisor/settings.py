"""Supervisor settings: CLI > `LOCKSTEP_<NAME>` environment > defaults.

A field's name is the setting's one name: flag `--peer-abort-grace`, variable
`LOCKSTEP_PEER_ABORT_GRACE`, field `peer_abort_grace` here and in each rank's
`RankSettings` (job_launch.RANK_FIELDS); ranges are on the field types (common/config.py).

| setting | default | meaning |
|---|---|---|
| home | `~/.lockstep` | `$LOCKSTEP_HOME` |
| admin_port / events_port | 7710 / 7711 | admin ROUTER, events PUB (on bind_host); 0 = any free port |
| control_port / report_port | 7712 / 7713 | control PUB, report ROUTER (on rank_host); 0 = any free port |
| bind_host | 127.0.0.1 | where admin and events bind |
| rank_host | 127.0.0.1 | where control and report bind, the address ranks connect to |
| load_timeout | 120 | seconds for every rank to become ready (`LOCKSTEP_LOAD_TIMEOUT`) |
| graceful_timeout | 5 | seconds a rank gets to exit after a control `shutdown` |
| stop_timeout | 10 | seconds after SIGTERM before SIGKILL |
| kill_timeout | 5 | seconds after each SIGKILL |
| lease_interval / lease_ttl | 1.0 / 45 | supervisor lease renewal and the staleness ranks act on |
| peer_abort_grace | 5.0 | rank 0 re-probes a lost peer this long after aborting in-flight requests, then exits `peer_lost` (0: at once) |
| progress_stall_timeout | 120 | a rank with active requests and no step for this long exits `failed` (0: off) |
| signal_clear_timeout | 10 | after SIGTERM/SIGINT/shutdown a rank that has not exited by then leaves anyway (code 3) |
| canary_runs / canary_window_s / canary_tokens / canary_timeout_s | 3 / 1.0 / 4 / 60 | canary |
| abort_all_timeout | 15 | bound on abort_all's wait for acks and zero active requests |
| cancel_timeout | 10 | how long a cancel is re-sent before unacked ranks are reported missing |
| rank_command | (empty) | command that starts one rank, `--spec FILE` appended; empty = `python -m services.rank` |
| rank_telemetry_interval_s | 1.0 | telemetry period written into each rank's spec |
| max_open_requests | 0 | rank 0 refuses a request (429 at the gateway) while this many are open; 0 = 8 x max_batch (128) |
| prompt_cache_entries | 32 | prefix-cache entries every rank may hold (LRU, decided by rank 0); 0 = the prefix cache is off |
| prompt_cache_bytes | 0 | prefix-cache bytes of KV per rank; 0 = auto: min(4 GiB, this host's physical memory / 8), resolved once here so every rank gets the same number |
| prompt_cache_disk_bytes | -1 | the prefix cache's disk tier: bytes of KV per rank under `$LOCKSTEP_HOME/kvcache` on each rank's host (entries written through, MAC-checked when read back, kept across restarts); -1 = auto: min(64 GiB, a tenth of the free disk of this host's home), resolved once here; 0 = off |
| kv_budget_bytes | -1 | bytes of KV per rank for running requests, enforced by rank 0's admission (services/rank/kv_budget.py): a request waits until its reservation fits, one that cannot fit alone is refused (400); -1 = auto: (90 % of this host's physical memory − the model's weights) / the deployment's ranks − prompt_cache_bytes, resolved once here per deployment (a deploy whose auto value is ≤ 0 is refused with the numbers); 0 = off |
| prefill_stall_ratio | 3 | while streams decode and a long prompt (see prefill_long_prompt) prefills, rank 0 sizes each step's prompt chunk so the step takes at most X times a decode-only step (more while more prompts wait than streams run); 0 = never: always prefill_step_decoding chunks |
| prefill_step_decoding | 512 | the prompt chunk while streams decode and no long prompt prefills (or prefill_stall_ratio is 0) |
| prefill_long_prompt | 2048 | a prompt with more tokens than this to compute is long: prefilled in steered chunks while streams decode; 0 = every prompt |
| deterministic | true | every rank runs the batch-invariant forward pass (services/rank/determinism.py): a request's tokens and logprobs depend on the request alone, not on its batch, prefill chunk, prefix-cache hit or resume point; `--no-deterministic` runs mlx-lm's own (faster, see README "Determinism") |
| speculative | off | `ngram`: rank 0 proposes drafts by prompt lookup (the n-gram the request's latest tokens end with, found earlier in its prompt or output) and every rank verifies them in one step (services/rank/spec_step.py): a request's tokens and logprobs stay plain decoding's, fewer steps when drafts are right; needs `deterministic` |
| adopt_window_s | 0 | a local rank whose supervisor (its parent) died keeps serving this long for a restarted supervisor to adopt it, then exits `launcher_lost`; 0 = at once (`lockstep up` sets it: its `--adopt-window`) |
| adopt_timeout | 15 | a restarted supervisor's bound on proving a running launch's ranks before it tears the launch down (docs/supervisor.md "Adoption") |
| rank_test_seams | false | lets ranks honour LOCKSTEP_TEST_* fault switches (tests only) |
| hosts | (none) | hosts file (mlx.launch format) for deploys that name no hosts (`--hosts FILE`) |
| ssh_config | (empty) | ssh client config (`ssh -F`) for remote hosts that set none of their own |
| ssh_connect_timeout | 5 | ssh ConnectTimeout, seconds |
| ssh_command_timeout | 30 | deadline of one remote host-agent command (its own waits come on top) |
| remote_poll_s | 0.5 / x10 | pause between marker/liveness polls of remote hosts while loading (serving: x10) |

With remote hosts, control and report must be reachable from them: when `rank_host` is
a loopback address, the supervisor also binds both on its own address towards each
remote host (the source address its routing table picks) and gives ranks there those
endpoints; otherwise every rank gets `rank_host`.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import (
    AtLeastOne,
    AutoCount,
    ConfigError,
    Count,
    Port,
    PositiveSeconds,
    Seconds,
    StallRatio,
    load_settings,
)
from common.home import default_home
from common.messages.vocab import Speculation
from common.rankspec import speculation_problem


@dataclass(frozen=True)
class SupervisorSettings:
    home: Path = field(default_factory=default_home)
    admin_port: Port = 7710
    events_port: Port = 7711
    control_port: Port = 7712
    report_port: Port = 7713
    bind_host: str = "127.0.0.1"
    rank_host: str = "127.0.0.1"
    load_timeout: PositiveSeconds = 120.0
    graceful_timeout: Seconds = 5.0
    stop_timeout: Seconds = 10.0
    kill_timeout: Seconds = 5.0
    lease_interval: PositiveSeconds = 1.0
    # Rank settings under the same name as in RankSettings (launch.rank_settings):
    lease_ttl: Seconds = 45.0
    peer_abort_grace: Seconds = 5.0  # rank watchdogs (services/rank/watchdogs.py)
    progress_stall_timeout: Seconds = 120.0
    signal_clear_timeout: Seconds = 10.0
    rank_telemetry_interval_s: PositiveSeconds = 1.0
    max_open_requests: Count = 0  # rank 0's bound (common.rankspec.RankSettings)
    prompt_cache_entries: Count = 32  # 0: prefix cache off
    prompt_cache_bytes: Count = 0  # per rank; 0: auto (job_launch.rank_settings resolves it)
    prompt_cache_disk_bytes: AutoCount = -1  # per rank; -1: auto; 0: off (rank_settings)
    kv_budget_bytes: AutoCount = -1  # per rank; -1: auto; 0: off (job_launch.kv_budget)
    prefill_stall_ratio: StallRatio = 3.0  # rank 0's prefill policy (rank/prefill_policy.py)
    prefill_step_decoding: AtLeastOne = 512
    prefill_long_prompt: Count = 2048
    rank_test_seams: bool = False
    deterministic: bool = True  # the batch-invariant forward pass (rank/determinism.py)
    speculative: Speculation = Speculation.OFF  # rank 0's drafts (rank/spec_propose.py)
    adopt_window_s: Seconds = 0.0  # a parentless local rank waits this long to be adopted
    adopt_timeout: PositiveSeconds = 15.0  # adoption.py: proof of a running launch's ranks
    canary_runs: AtLeastOne = 3
    canary_window_s: Seconds = 1.0
    canary_tokens: AtLeastOne = 4
    canary_timeout_s: PositiveSeconds = 60.0
    abort_all_timeout: Seconds = 15.0
    cancel_timeout: Seconds = 10.0
    rank_command: str = ""
    hosts: Path | None = None
    ssh_config: str = ""
    ssh_connect_timeout: PositiveSeconds = 5.0
    ssh_command_timeout: PositiveSeconds = 30.0
    remote_poll_s: PositiveSeconds = 0.5

    def rank_argv(self, spec_path: Path) -> list[str]:
        base = shlex.split(self.rank_command) or [sys.executable, "-m", "services.rank"]
        return [*base, "--spec", str(spec_path)]


def load(cli: dict | None = None, env: dict | None = None) -> SupervisorSettings:
    s = load_settings(SupervisorSettings, cli, env)
    if why := speculation_problem(s.speculative, s.deterministic):
        raise ConfigError(why)
    return s
