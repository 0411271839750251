"""Resume: a request whose deployment failed goes on, token for token, on a serving
deployment of the same model (the one `lockstep up` redeploys, or another already
serving), and its client sees one unbroken response.

What makes it exact: the gateway keeps the request's GENERATE (with the seed it drew
when the client named none) and every token streamed so far. The continuation is one
GENERATE: the prompt plus those tokens, the remaining max_tokens, the same seed, and
`resumed` = how many of the prompt's last tokens are output, so every rank's sampler
keys go on from that index, penalties count them as output, and the grammar matcher is
advanced over them (services/rank/sampling.py). The stream object keeps its place in
the HTTP handler; only its backend and request id change (`Backend.adopt`), and the
Generation's detokenizer, stop matcher, parsers and logprobs go on as they were.

Only failures resume (RESUMABLE below: the stream's end carries a failure's typed code).
A cancellation never does: a client gone, an abort, abort-all, unload, stop. Bounds:
`resume_timeout` (0: off, today's behaviour) for a serving deployment to appear, and
`resume_max` attempts per request; past either, the rank_lost error with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import Any

from common.messages import ErrorCode, Generate, Phase
from services.gateway.core.refusals import Cancelled
from services.gateway.core.request_channel import Backend, RequestStream, Unavailable

log = logging.getLogger("lockstep.gateway.resume")
# Failures, typed: the link to rank 0 closed; the supervisor says the deployment failed;
# rank 0 left on a failure (a graceful stop ends streams as a plain abort instead); a
# watchdog's abort stage (a peer lost). A cancellation carries none of these.
RESUMABLE = frozenset({ErrorCode.RANK_LOST, ErrorCode.DEPLOYMENT_FAILED,
                       ErrorCode.RANK_STOPPED, ErrorCode.WATCHDOG_ABORT})
# A continuation refused in-band by the rank 0 it was sent to (at its bound, not serving
# yet): not an answer for the client. It waits on (the same deadline) and is sent again,
# to a deployment with room if there is one; a refusal is not a resume (resume_max).
REFUSED = frozenset({ErrorCode.OVERLOADED, ErrorCode.NOT_SERVING})
POLL_S = 0.1  # how often a waiting request looks for a serving deployment
REFUSED_BACKOFF_S = 0.25  # before a refused continuation is sent again
STATS_TIMEOUT_S = 1.0


class Outcome(enum.Enum):
    RESUMED = "resumed"
    CANCELLED = "cancelled"  # the client left, or an abort reached it while it waited
    GAVE_UP = "gave_up"


@dataclasses.dataclass
class Result:
    outcome: Outcome
    why: str = ""


class Resumer:
    """One choice's resume state: its GENERATE, and how often it resumed."""

    def __init__(self, cluster: Any, msg: Generate, model: str, model_path: str | None, *,
                 timeout: float, max_resumes: int, metrics: Any = None,
                 router: Any = None) -> None:
        self.cluster, self.msg = cluster, msg
        self.router = router  # services/gateway/core/router.py; None: the least loaded
        self.model, self.model_path = model, model_path
        self.timeout, self.max_resumes = timeout, max_resumes
        self.metrics = metrics
        self.resumes = 0
        self.attempts = 0  # continuations sent (their ids), refused ones included
        self.failed_at: float | None = None  # monotonic: the failure not yet recovered
        self.deadline: float | None = None  # of the wait for that failure's continuation
        self._entry: dict | None = None  # the last resume's row in the cluster's resume log

    def wants(self, code: ErrorCode | None) -> bool:
        if self.timeout <= 0:
            return False
        # a refusal only of a continuation that has not produced a token yet
        return code in RESUMABLE or (code in REFUSED and self.failed_at is not None
                                     and self.resumes > 0)

    def remaining(self, produced: int) -> int:
        return self.msg.max_tokens - produced

    def _route(self, exclude: Backend | None, ids: list[int]) -> tuple[Backend, int] | None:
        """Where the continuation goes, and how much of prompt + produced tokens its
        cache is expected to hold: among the serving deployments of the model, those
        with room first (a continuation may exceed the gateway's bound, never by
        choice), then the router's cache-aware rule on the continuation's own tokens,
        as a new request is routed (router.py)."""
        live = [b for b in self.cluster.backends.values()
                if b is not exclude and not b.lost and not b.closed and not b.draining
                and b.model == self.model
                and b.model_path == self.model_path]
        if not live:
            return None
        roomy = [b for b in live if not b.full()] or live
        if self.router is not None:
            route = self.router.choose(roomy, ids)
            return route.backend, route.cached
        # no router (tests): the least loaded; ties by id, so equal loads do not pile
        # onto one deployment
        return min(roomy, key=lambda b: (b.active, b.deployment_id)), 0

    async def resume(self, s: RequestStream, produced: list[int], code: ErrorCode) -> Result:
        """Wait for a serving deployment and send the continuation on it (s rebound)."""
        cause = code.value
        refused = code in REFUSED
        if refused:  # the last continuation was refused: it did not resume
            self.resumes -= 1
        if self.resumes >= self.max_resumes:
            return self._gave_up(cause, f"resumed {self.resumes} time(s) already "
                                 f"(resume_max {self.max_resumes})")
        if not refused or self.deadline is None:
            self.failed_at = time.monotonic()
            self.deadline = self.failed_at + self.timeout
        deadline = self.deadline
        old, old_id = s.backend, s.request_id
        old.forget(s)  # the old rank 0 may have survived (a link blip): end it there
        self.cluster.resuming.add(s)
        try:
            if refused:  # not straight back at a rank 0 that is at its bound
                await asyncio.sleep(REFUSED_BACKOFF_S)
            while True:
                if s.released or s.abort_reason is not None:
                    return Result(Outcome.CANCELLED, s.abort_reason or "client gone")
                if self.cluster.shutting_down:
                    return self._gave_up(cause, "the gateway is shutting down")
                ids = [*self.msg.prompt, *produced]
                route = self._route(None if refused else old, ids)  # a refuser may take it later
                if route is None and code is ErrorCode.WATCHDOG_ABORT \
                        and await self._recovered(old):
                    route = (old, 0)  # the peer answered again within its grace: serving on there
                if s.released or s.abort_reason is not None:  # the probe above awaited
                    return Result(Outcome.CANCELLED, s.abort_reason or "client gone")
                if route is not None:
                    b, cached = route
                    n = self.resumes + 1
                    self.attempts += 1
                    gen = dataclasses.replace(
                        self.msg, request_id=f"{self.msg.request_id}-r{self.attempts}",
                        prompt=ids,
                        max_tokens=self.remaining(len(produced)),
                        resumed=self.msg.resumed + len(produced))
                    try:
                        await b.adopt(s, gen, cached)  # refuses a stream cancelled meanwhile
                    except Cancelled as exc:
                        return Result(Outcome.CANCELLED, str(exc))
                    except Unavailable as exc:
                        log.info("resume of %s on %s refused: %s", old_id, b.deployment_id, exc)
                    else:
                        self.resumes = n
                        if not refused:  # a retry after a refusal is the same resume
                            self.cluster.resumed_from[old.deployment_id] += 1
                            if self.metrics is not None:
                                self.metrics.resumes.labels(cause=cause).inc()
                        if refused and self._entry is not None:  # the same resume, re-sent
                            self._entry.update({"as": gen.request_id, "to": b.deployment_id})
                            self._entry["refusals"] += 1
                        else:
                            self._entry = {
                                "request_id": old_id, "as": gen.request_id,
                                "from": old.deployment_id, "to": b.deployment_id,
                                "tokens": len(produced), "cause": cause, "at": time.time(),
                                "refusals": 0}  # in-band refusals it met on the way
                            self.cluster.resume_log.append(self._entry)
                        log.info("request %s resumed as %s on %s after %d token(s) (%s)",
                                 old_id, gen.request_id, b.deployment_id, len(produced), cause)
                        return Result(Outcome.RESUMED)
                if time.monotonic() >= deadline:
                    return self._gave_up(cause, f"no serving deployment of {self.model!r} "
                                         f"within {self.timeout:g}s (resume_timeout)")
                await asyncio.sleep(POLL_S)
        finally:
            self.cluster.resuming.discard(s)

    async def _recovered(self, old: Backend) -> bool:
        """The deployment whose rank 0 aborted on a silent peer serves on: the peer
        answered within the grace (rank 0's STATS says peers_ok again). Until then, or
        if it fails for good (the link closes, the supervisor says failed), it is not
        resumed there: a continuation would only be aborted again."""
        if old.lost or old.closed or old not in self.cluster.backends.values():
            return False
        try:
            stats = await old.stats(timeout=STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer is no proof
            return False
        return bool(getattr(stats, "peers_ok", False)) and stats.phase == Phase.SERVING

    def first_token(self) -> None:
        """The first token after a resume reached the gateway: the time since the failure."""
        if self.failed_at is not None and self.metrics is not None:
            self.metrics.resume_first_token.observe(time.monotonic() - self.failed_at)
        self.failed_at = None

    def _gave_up(self, cause: str, why: str) -> Result:
        if self.metrics is not None:
            self.metrics.resume_gave_up.labels(cause=cause).inc()
        return Result(Outcome.GAVE_UP, why)
