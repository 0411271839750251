"""Gateway settings: CLI > `LOCKSTEP_<NAME>` environment > defaults.

| setting | default | meaning |
|---|---|---|
| home | `~/.lockstep` | `$LOCKSTEP_HOME`: cluster key, admin token, supervisor.json |
| host | 127.0.0.1 | HTTP bind address (loopback only unless told otherwise) |
| port | 8000 | HTTP port |
| admin_token | (file) | admin bearer token; else `$LOCKSTEP_HOME/admin.token` (0600) |
| api_keys | (none) | comma-separated OpenAI API keys; empty = open |
| request_read_timeout | 300 | seconds without a token before a request is cancelled |
| orphan_grace_s | 5 | seconds before an abandoned stream is reaped |
| max_body_bytes | 4 MiB | larger request bodies get 413 |
| keepalive_s | 5 | SSE keep-alive comment period while no token arrives |
| canary_fresh_s | 60 | a serving deployment's last good generation must be this recent |
| default_max_tokens | 512 | max_tokens when the client gives none (capped by context) |
| admin_endpoint / events_endpoint | (supervisor.json) | supervisor sockets |
| reaper_events_endpoint | (none) | the reaper's events PUB (reap passes), subscribed too |
| admin_timeout_s | 10 | deadline for ordinary admin calls |
| refresh_s | 2 | deployments poll period (backstop for events) |
| abort_all_timeout_s | 15 | bound on abort-all's wait for zero active everywhere |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common.config import default_home, load_settings

TOKEN_FILE = "admin.token"


@dataclass(frozen=True)
class GatewaySettings:
    home: Path = field(default_factory=default_home)
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None
    api_keys: tuple[str, ...] = ()
    request_read_timeout: float = 300.0
    orphan_grace_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    keepalive_s: float = 5.0
    canary_fresh_s: float = 60.0
    default_max_tokens: int = 512
    admin_endpoint: str | None = None
    events_endpoint: str | None = None
    reaper_events_endpoint: str | None = None
    admin_timeout_s: float = 10.0
    refresh_s: float = 2.0
    abort_all_timeout_s: float = 15.0
    log_level: str = "info"

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
    s = load_settings(GatewaySettings, cli, env if env is not None else dict(os.environ))
    return s
