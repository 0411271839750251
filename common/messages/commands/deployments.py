"""deployments — every deployment the supervisor holds, with each rank's state. Carries
`requests_key_sealed`: the launch's requests key, AES-GCM-sealed under a key derived from
the cluster key (common.keys.seal_key / requests_key_of), so only a holder of the cluster
key (the gateway) can open it, and neither this reply nor `lockstep admin status` output
shows it in clear. The launch secret itself never leaves the supervisor.

    request  {}
    reply    {deployments: [DeploymentInfo]}   (common/deployment_info.py)
    CLI      lockstep admin deployments [--json]
"""

from __future__ import annotations

from dataclasses import dataclass

from common.deployment_info import DeploymentInfo
from common.messages.report import CacheStats


@dataclass
class Args:
    pass


def _cache_text(c: CacheStats | None) -> str:
    if c is None:  # off, or no telemetry with it yet
        return "  cache -"
    return f"  cache {c.entries} entries {c.tokens} tokens {c.bytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Reply:
    deployments: list[DeploymentInfo]

    def get(self, deployment_id: str) -> DeploymentInfo | None:
        return next((d for d in self.deployments if d.deployment_id == deployment_id), None)

    def render(self) -> str:
        lines = []
        for d in self.deployments:
            lines.append(f"{d.deployment_id}  {d.state:<15} {d.model} tp={d.tp} "
                         f"pp={d.pp} backend={d.backend} job={d.job_id}"
                         + (f"  error: {d.error}" if d.error else ""))
            for r in d.ranks:
                lines.append(f"    rank {r.rank} pid {r.pid:<7} {r.phase:<10} "
                             f"step {r.step:<6} active {r.active:<3} "
                             f"acked epoch {r.acked_epoch}" + _cache_text(r.cache))
        if not self.deployments:
            lines.append("no deployments")
        return "\n".join(lines)
