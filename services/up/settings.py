"""`lockstep up`'s settings: CLI > LOCKSTEP_<NAME> > these defaults (common/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from common.config import (
    AtLeastOne,
    AutoCount,
    Count,
    Port,
    PositiveSeconds,
    Seconds,
    StallRatio,
)
from common.home import default_home
from common.messages.vocab import Speculation
from common.request_params import deployable
from common.sampling_defaults import FIELDS as SAMPLING_FIELDS
from common.sampling_defaults import SamplingOverrides


@dataclass(frozen=True)
class _UpSettings:
    home: Path = field(default_factory=default_home)
    host: str = "127.0.0.1"
    port: Port = 8000
    model: str | None = None
    # None = not named: the preset's (SmolLM2: pp=2), else tp=2 (model.py)
    tp: AtLeastOne | None = None
    pp: AtLeastOne | None = None
    hosts: Path | None = None
    backend: str = "auto"
    admin_port: Port = 7710
    events_port: Port = 7711
    control_port: Port = 7712
    report_port: Port = 7713
    reaper_events_port: Port = 7714
    ready_timeout: PositiveSeconds = 600.0
    stop_timeout: PositiveSeconds = 15.0
    # redeploys after a deployment fails (a rank died, a peer was lost): at most `restarts`
    # within any `restart_window` seconds, spaced by a doubling backoff from
    # `restart_backoff` (services/up/restart_budget.py)
    restarts: Count = 3
    restart_window: PositiveSeconds = 600.0
    restart_backoff: Seconds = 2.0
    # a supervisor that dies is restarted, at most `supervisor_restarts` times within any
    # `restart_window` (0: never), and adopts the ranks it left serving; a local rank
    # waits `adopt_window` seconds for that (services/up/supervisor_keeper.py)
    supervisor_restarts: Count = 3
    adopt_window: Seconds = 30.0
    replicas: AtLeastOne = 1  # deployments of the model behind the gateway (replicas.py)
    # The supervisor's settings of the same names, handed to it as its flags (every rank
    # gets them through its spec): 0 entries = prefix cache off; 0 bytes = auto; disk
    # bytes -1 = auto, 0 = no disk tier.
    prompt_cache_entries: Count = 32
    prompt_cache_bytes: Count = 0
    prompt_cache_disk_bytes: AutoCount = -1
    kv_budget_bytes: AutoCount = -1  # KV for running requests per rank; -1 auto, 0 off
    prefill_stall_ratio: StallRatio = 3.0  # rank 0's prefill policy; 0 = fixed chunks
    prefill_long_prompt: Count = 2048  # ... steered while streams decode; 0 = every prompt
    deterministic: bool = True  # the batch-invariant forward pass; False: mlx-lm's own
    speculative: Speculation = Speculation.OFF  # ngram: rank 0's prompt-lookup drafts


# Plus the deployment's sampling defaults, one setting per parameter common/request_params.py
# declares `deployable` (None = the preset's, the model's, then OpenAI's): `--min-p`,
# LOCKSTEP_MIN_P, ...
UpSettings = make_dataclass(
    "UpSettings", [(p.name, p.kind | None, field(default=None)) for p in deployable()],
    bases=(_UpSettings,), frozen=True, namespace={"__module__": __name__})


def named_sampling(s: UpSettings) -> SamplingOverrides:  # type: ignore[valid-type]
    return SamplingOverrides(**{k: getattr(s, k) for k in SAMPLING_FIELDS})
