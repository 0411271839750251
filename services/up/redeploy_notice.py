"""`lockstep up` tells the gateway it redeploys a model that fails
(runtime/redeploy.json, common.records.RedeployRecord): written once the deployment
serves (from then on a failure is redeployed), rewritten with the failure while it is
being redeployed, removed when the redeploy rate is spent (nothing is coming back:
requests get 503 at once), when an operator stops the deployment, and when `up` stops.
While it stands and nothing serves the model, the gateway holds requests for it (at most
its `admit_wait`) instead of answering 503: there is no gap between the gateway seeing a
failure and `up` seeing it."""

from __future__ import annotations

import os

from common.home import Paths, write_redeploy_record
from common.procs import identify
from common.records import RedeployRecord


class RedeployNotice:
    def __init__(self, paths: Paths) -> None:
        self.path = paths.redeploy_file

    def promise(self, model: str, reason: str = "") -> None:
        me = identify(os.getpid())
        if me is None:
            return
        write_redeploy_record(self.path, RedeployRecord(
            up_pid=me.pid, up_start_time=me.start_time, model=model, reason=reason))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
