"""A DeploymentInfo for tests that need one without a supervisor: every required field
filled, the given ones over them."""

from __future__ import annotations

from typing import Any

from common.deployment_info import DeploymentInfo
from common.messages import Backend, DeploymentState


def deployment_info(**over: Any) -> DeploymentInfo:
    fields: dict[str, Any] = dict(
        deployment_id="d-1", job_id="j-1", state=DeploymentState.SERVING, model="m",
        model_path="", tp=1, pp=1, backend=Backend.NONE, world_size=1,
        requests_endpoint="", requests_key_sealed="", canary_at=None, error=None,
        teardown=None, ranks=[])
    fields.update(over)
    return DeploymentInfo(**fields)
