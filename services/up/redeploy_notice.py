"""`lockstep up` tells the gateway a model is coming back (runtime/redeploy.json,
common.records.RedeployRecord): written when `up` decides to redeploy a failed deployment,
removed once the new one serves, when the redeploy rate is spent (nothing is coming
back: requests get 503 at once) and when `up` stops. While it stands, the gateway holds
requests for that model (at most its `admit_wait`) instead of answering 503."""

from __future__ import annotations

import os
import time

from common.home import Paths, write_redeploy_record
from common.procs import identify
from common.records import RedeployRecord


class RedeployNotice:
    def __init__(self, paths: Paths) -> None:
        self.path = paths.redeploy_file

    def announce(self, model: str, within_s: float, reason: str) -> None:
        me = identify(os.getpid())
        if me is None:
            return
        write_redeploy_record(self.path, RedeployRecord(
            up_pid=me.pid, up_start_time=me.start_time, model=model,
            until=time.time() + within_s, reason=reason))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
