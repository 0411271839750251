"""A continuation refused in-band (services/gateway/core/resume.py REFUSED: the new rank 0 at
its bound, or not serving yet) is not an answer for the client: wanted again only while
it has produced no token, sent again under a new id to a deployment with room first,
within the first failure's deadline, and not counted as a resume (resume_max)."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

from common.messages import ErrorCode, Generate
from services.gateway.core import resume as resume_mod
from services.gateway.core.resume import Outcome, Resumer


class FakeBackend:
    def __init__(self, dep_id: str, active: int = 0, full: bool = False) -> None:
        self.deployment_id, self.active, self._full = dep_id, active, full
        self.lost = self.closed = self.draining = False
        self.model, self.model_path = "tiny", "/m"
        self.sent: list[str] = []

    def full(self, more: int = 1) -> bool:
        return self._full

    async def adopt(self, s, gen: Generate, cached: int = 0) -> None:
        self.sent.append(gen.request_id)
        s.backend = self

    def forget(self, s) -> None:
        pass


class Stream:
    def __init__(self, backend) -> None:
        self.backend, self.request_id = backend, "r"
        self.released, self.abort_reason = False, None


def stream(backend) -> Stream:
    return Stream(backend)


def test_a_refused_continuation_is_sent_again_to_one_with_room_and_is_not_a_resume(monkeypatch):
    monkeypatch.setattr(resume_mod, "REFUSED_BACKOFF_S", 0.0)
    failed = FakeBackend("d-1")
    busy, roomy = FakeBackend("d-2", active=0, full=True), FakeBackend("d-3", active=9)
    cluster = SimpleNamespace(backends={"d-2": busy}, resuming=set(), shutting_down=False,
                              resumed_from={"d-1": 0, "d-2": 0}, resume_log=[])
    r = Resumer(cluster, Generate(request_id="r", prompt=[1, 2], max_tokens=10, client="t"),
                "tiny", "/m", timeout=30.0, max_resumes=1)
    s = stream(failed)

    async def go():
        first = await r.resume(s, [7], ErrorCode.RANK_LOST)
        assert first.outcome is Outcome.RESUMED and busy.sent == ["r-r1"]
        deadline = r.deadline
        # d-2 refuses it (at its bound) before any token: wanted again, not given up
        assert r.wants(ErrorCode.OVERLOADED) and not r.wants(ErrorCode.INVALID_REQUEST)
        cluster.backends["d-3"] = roomy  # one with room appears
        again = await r.resume(s, [7], ErrorCode.OVERLOADED)
        assert again.outcome is Outcome.RESUMED
        assert roomy.sent == ["r-r2"] and r.resumes == 1 and r.deadline == deadline
        assert cluster.resumed_from == {"d-1": 1, "d-2": 0}  # one resume, from d-1
        r.first_token()
        assert not r.wants(ErrorCode.OVERLOADED)  # after a token it is an ordinary error

    asyncio.run(go())


def test_refusals_end_at_the_first_failure_s_deadline(monkeypatch):
    monkeypatch.setattr(resume_mod, "REFUSED_BACKOFF_S", 0.0)
    cluster = SimpleNamespace(backends={}, resuming=set(), shutting_down=False,
                              resumed_from=collections.Counter(), resume_log=[])
    only = FakeBackend("d-2")
    r = Resumer(cluster, Generate(request_id="r", prompt=[1], max_tokens=10, client="t"),
                "tiny", "/m", timeout=0.3, max_resumes=2)
    s = stream(FakeBackend("d-1"))

    async def go():
        cluster.backends["d-2"] = only
        assert (await r.resume(s, [], ErrorCode.RANK_LOST)).outcome is Outcome.RESUMED
        only.lost = "gone"  # nothing serves any more: the refusal's retry waits, then ends
        got = await r.resume(s, [], ErrorCode.NOT_SERVING)
        assert got.outcome is Outcome.GAVE_UP and "resume_timeout" in got.why

    asyncio.run(go())
