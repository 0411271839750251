"""services/gateway/core/admit_wait.py's decisions, on a stand-in gateway whose `pick` answers
as the real one does (503 while nothing serves, then the backends): a recorded redeploy
is waited for, nothing coming back is refused at once, the queue bound is a 429, and
abort-all, shutdown and the deadline end a wait with 503."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.gateway.core import admit_wait
from services.gateway.core.admit_wait import pick_or_wait
from services.gateway.core.errors import ApiError
from services.gateway.core.settings import GatewaySettings


class Gw:
    def __init__(self, serving_after: int | None, coming_back: str | None = "a rank died",
                 **settings) -> None:
        self.settings = GatewaySettings(**settings)
        self.calls, self.serving_after = 0, serving_after
        self.cluster = SimpleNamespace(admit_waiting=0, admit_aborts=0, shutting_down=False,
                                       coming_back=lambda model: self.back)
        self.back = coming_back

    def pick(self, model: str, n: int = 1) -> list:
        self.calls += 1
        if self.serving_after is not None and self.calls > self.serving_after:
            return ["backend"]
        raise ApiError(503, "not serving", code="model_not_ready")


class Client:
    def __init__(self, gone_after: int | None = None) -> None:
        self.n, self.gone_after = 0, gone_after

    async def is_disconnected(self) -> bool:
        self.n += 1
        return self.gone_after is not None and self.n > self.gone_after


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(admit_wait, "POLL_S", 0.001)
    monkeypatch.setattr(admit_wait, "RECORD_POLL_S", 0.0)


def run(coro):
    return asyncio.run(coro)


def test_a_recorded_redeploy_is_waited_for_and_the_request_admitted():
    gw = Gw(serving_after=5)
    assert run(pick_or_wait(gw, Client(), "tiny", 1)) == ["backend"]
    assert gw.calls == 6 and gw.cluster.admit_waiting == 0


def test_nothing_coming_back_or_waiting_off_is_the_503_at_once():
    for gw in (Gw(serving_after=5, coming_back=None), Gw(serving_after=5, admit_wait=0)):
        with pytest.raises(ApiError) as e:
            run(pick_or_wait(gw, Client(), "tiny", 1))
        assert e.value.status == 503 and gw.calls == 1


def test_the_record_withdrawn_mid_wait_ends_it_with_pick_s_own_answer():
    gw = Gw(serving_after=None)

    async def go():
        task = asyncio.create_task(pick_or_wait(gw, Client(), "tiny", 1))
        await asyncio.sleep(0.02)
        gw.back = None  # `up` gave up: the redeploy rate is spent
        return await task

    with pytest.raises(ApiError) as e:
        run(go())
    assert e.value.status == 503 and e.value.message == "not serving"


def test_past_the_queue_bound_429_with_retry_after():
    gw = Gw(serving_after=None, admit_queue=2)
    gw.cluster.admit_waiting = 2
    with pytest.raises(ApiError) as e:
        run(pick_or_wait(gw, Client(), "tiny", 1))
    assert e.value.status == 429 and e.value.headers["retry-after"] == "1"


@pytest.mark.parametrize("end", ["abort_all", "shutdown", "client_gone", "deadline"])
def test_a_wait_ends_on_abort_all_shutdown_client_gone_and_its_deadline(end):
    gw = Gw(serving_after=None, admit_wait=0.05 if end == "deadline" else 60.0)
    client = Client(gone_after=3 if end == "client_gone" else None)

    async def go():
        task = asyncio.create_task(pick_or_wait(gw, client, "tiny", 1))
        await asyncio.sleep(0.02)
        if end == "abort_all":
            gw.cluster.admit_aborts += 1
        elif end == "shutdown":
            gw.cluster.shutting_down = True
        return await asyncio.wait_for(task, 10)

    with pytest.raises(ApiError) as e:
        run(go())
    want = {"abort_all": (503, "abort-all"), "shutdown": (503, "shutting down"),
            "client_gone": (499, "closed"), "deadline": (503, "admit_wait")}[end]
    assert (e.value.status, want[1] in e.value.message) == (want[0], True), e.value.message
    assert gw.cluster.admit_waiting == 0


def test_a_model_forgotten_while_another_serves_is_waited_for_only_if_promised():
    class Forgotten(Gw):
        def pick(self, model: str, n: int = 1) -> list:
            self.calls += 1
            if self.serving_after is not None and self.calls > self.serving_after:
                return ["backend"]
            raise ApiError(404, "model 'tiny' not found", code="model_not_found")

    assert run(pick_or_wait(Forgotten(serving_after=3), Client(), "tiny", 1)) == ["backend"]
    with pytest.raises(ApiError) as e:
        run(pick_or_wait(Forgotten(serving_after=3, coming_back=None), Client(), "tiny", 1))
    assert e.value.status == 404
