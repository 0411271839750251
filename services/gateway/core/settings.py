"""Gateway settings: CLI > `LOCKSTEP_<NAME>` environment > defaults.

| setting | default | meaning |
|---|---|---|
| home | `~/.lockstep` | `$LOCKSTEP_HOME`: cluster key, admin token, supervisor.json |
| host | 127.0.0.1 | HTTP bind address (loopback only unless told otherwise) |
| port | 8000 | HTTP port |
| admin_token | (file) | admin bearer token; else `$LOCKSTEP_HOME/admin.token` (0600) |
| api_keys | (none) | comma-separated API keys, each `KEY` or `NAME:KEY` (unnamed: `key-<i>`); empty = open |
| api_key_weights | (none) | comma-separated `NAME=W` (1..1000, default 1): a key's turn in rank 0's queue within a priority and its share of max_inflight |
| api_key_max_priority | (none) | comma-separated `NAME=P`: the most urgent `priority` the key may ask (lower is more urgent); none = any |
| request_read_timeout | 300 | seconds without a token (or rank 0's "still waiting" heartbeat) before a request is cancelled |
| orphan_grace_s | 5 | seconds before an abandoned stream is reaped |
| max_body_bytes | 4 MiB | larger request bodies get 413 |
| input_bytes_per_token | 8 | a prompt (chat: the rendered template) over context x this many UTF-8 bytes is refused before tokenizing |
| max_messages / max_tools | 4096 / 128 | per request; more is a 400 before validation |
| prepare_threads | 2 | worker threads that parse, render and tokenize (at most this many prompts at once) |
| ready_view_max_age_s | 15 | /ready is 503 when the supervisor's last answer is older than this |
| keepalive_s | 5 | SSE keep-alive comment period while no token arrives |
| canary_fresh_s | 60 | a serving deployment's last good generation must be this recent |
| default_max_tokens | 512 | max_tokens when the client gives none (capped by context) |
| max_inflight | 0 | per deployment: requests in flight (running + waiting) beyond which a new one gets 429 at once; 0 = 4 x the rank's max_batch (64) |
| overload_retry_after_s | 1 | the `retry-after` of that 429 |
| admin_endpoint / events_endpoint | (supervisor.json) | supervisor sockets |
| reaper_events_endpoint | (none) | the reaper's events PUB (reap passes), subscribed too |
| admin_timeout_s | 10 | deadline for ordinary admin calls |
| refresh_s | 2 | deployments poll period (backstop for events) |
| abort_all_timeout_s | 15 | bound on abort-all's wait for zero active everywhere |
| resume_timeout | 120 | a request whose deployment failed waits this long for a serving deployment of its model to go on (token for token); 0 = off: it ends with rank_lost at once |
| resume_max | 2 | resumes per request; past it, rank_lost |
| admit_wait | 60 | a request for a model `lockstep up` is redeploying (runtime/redeploy.json) waits this long for the new deployment instead of a 503; 0 = 503 at once |
| admit_queue | 0 | requests waiting so at once; past it 429 with retry-after; 0 = max_inflight's value |
| route_imbalance | 1024 | replicas: a request goes to the replica caching most of its prompt unless that replica's load (prefill-token equivalents) exceeds the least loaded one's by more than this (services/gateway/core/router.py) |
| route_policy | cache | replicas: `cache` (the rule in services/gateway/core/router.py) or `round_robin` (in turn, the baseline the bench compares with) |
| route_index | approx | replicas: which prefix index routing reads: `approx` (what the gateway routed where) or `precise` (rank 0's cache events) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.config import (
    AtLeastOne,
    ConfigError,
    Count,
    Port,
    PositiveSeconds,
    Seconds,
    load_settings,
)
from common.home import default_home
from common.rankspec import RankSettings
from services.gateway.core.auth import KeyTable

TOKEN_FILE = "admin.token"
# The default bound: 4 batches' worth per deployment (one running, three waiting), half
# of rank 0's own default bound (8 x max_batch), so this gateway's 429 comes first.
INFLIGHT_PER_SLOT = 4


@dataclass(frozen=True)
class GatewaySettings:
    home: Path = field(default_factory=default_home)
    host: str = "127.0.0.1"
    port: Port = 8000
    admin_token: str | None = None
    api_keys: tuple[str, ...] = ()
    api_key_weights: tuple[str, ...] = ()  # name=w (services/gateway/core/auth.py)
    api_key_max_priority: tuple[str, ...] = ()  # name=p
    request_read_timeout: PositiveSeconds = 300.0
    orphan_grace_s: Seconds = 5.0
    max_body_bytes: AtLeastOne = 4 * 1024 * 1024
    input_bytes_per_token: AtLeastOne = 8
    max_messages: AtLeastOne = 4096
    max_tools: Count = 128
    prepare_threads: AtLeastOne = 2
    ready_view_max_age_s: PositiveSeconds = 15.0
    keepalive_s: PositiveSeconds = 5.0
    canary_fresh_s: PositiveSeconds = 60.0
    default_max_tokens: AtLeastOne = 512
    max_inflight: Count = 0  # 0 = INFLIGHT_PER_SLOT x the rank's max_batch
    overload_retry_after_s: Count = 1
    admin_endpoint: str | None = None
    events_endpoint: str | None = None
    reaper_events_endpoint: str | None = None
    admin_timeout_s: PositiveSeconds = 10.0
    refresh_s: PositiveSeconds = 2.0
    abort_all_timeout_s: Seconds = 15.0
    resume_timeout: Seconds = 120.0  # 0 = off (services/gateway/core/resume.py)
    resume_max: Count = 2
    admit_wait: Seconds = 60.0  # 0 = off (services/gateway/core/admit_wait.py)
    admit_queue: Count = 0  # 0 = inflight_limit
    route_imbalance: Count = 1024  # services/gateway/core/router.py
    route_policy: str = "cache"  # cache | round_robin
    route_index: str = "approx"  # approx | precise
    log_level: str = "info"

    def __post_init__(self) -> None:
        KeyTable.parse(self.api_keys, self.api_key_weights, self.api_key_max_priority)
        if self.route_index not in ("approx", "precise"):
            raise ConfigError(f"route_index: {self.route_index!r} must be approx or precise")
        if self.route_policy not in ("cache", "round_robin"):
            raise ConfigError(f"route_policy: {self.route_policy!r} must be cache or round_robin")

    @property
    def inflight_limit(self) -> int:
        """Requests in flight per deployment beyond which a new one is refused (429)."""
        return self.max_inflight or INFLIGHT_PER_SLOT * RankSettings().max_batch

    @property
    def cluster_key_path(self) -> Path:
        return Path(self.home) / "keys" / "cluster.key"

    @property
    def supervisor_file(self) -> Path:
        return Path(self.home) / "runtime" / "supervisor.json"

    def resolved_admin_token(self) -> str | None:
        """The configured token, else the 0600 token file; None = admin API closed."""
        if self.admin_token:
            return self.admin_token
        path = Path(self.home) / TOKEN_FILE
        try:
            st = path.stat()
            if st.st_mode & 0o077:
                return None  # a readable-by-others token is refused (fail closed)
            text = path.read_text().strip()
        except OSError:
            return None
        return text or None


def load(cli: dict | None = None, env: dict | None = None) -> GatewaySettings:
    return load_settings(GatewaySettings, cli, env)
