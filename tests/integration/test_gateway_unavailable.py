"""A request routed to a deployment whose rank 0 is lost (or which is gone) by the time
its GENERATE is sent: 503 `model_not_ready` with `retry-after`, the answer routing gives
once it knows (app.pick), and nothing left registered. The Backend is real (a DEALER on
a loopback endpoint nobody serves: the loss is the state the link watch sets)."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio

from common.messages import Generate
from services.gateway.core.request_channel import Backend, Unavailable
from tests.support.bus import KEY
from tests.support.deployment import deployment_info
from tests.support.ports import free_port


def _generate() -> Generate:
    return Generate(request_id="r-1", prompt=[1, 2, 3], max_tokens=4, client="test")


def _check(err: Unavailable, backend: Backend) -> None:
    assert err.status == 503 and err.code == "model_not_ready"
    assert err.headers == {"retry-after": "5", "x-lockstep-deployment": "d-1"}
    assert "d-1" in err.message and backend.streams == {}
    assert err.body()["error"]["code"] == "model_not_ready"


async def test_lost_rank_0_and_a_gone_deployment_answer_503_model_not_ready_with_retry_after():
    ctx = zmq.asyncio.Context()
    info = deployment_info(requests_endpoint=f"tcp://127.0.0.1:{free_port()}")
    b = Backend(ctx, info, key=KEY)
    try:
        b.fail_lost("the connection to rank 0 closed")  # what the link watch calls
        with pytest.raises(Unavailable) as lost:
            await b.generate(_generate())
        _check(lost.value, b)
        assert "the connection to rank 0 closed" in lost.value.message
        b.close("deployment gone")
        with pytest.raises(Unavailable) as gone:
            await b.generate(_generate())
        _check(gone.value, b)
    finally:
        b.close()
        ctx.destroy(linger=0)


async def test_a_cancelled_stream_is_never_moved_by_a_resume():
    """issue 43 item 1: a continuation for a stream released (client gone) or aborted
    (abort-all) before it could move is refused (`Cancelled`), nothing is registered or
    sent on the new deployment; a move keeps any cancel that was set (rebind never
    clears abort_reason)."""
    from services.gateway.core.refusals import Cancelled
    from services.gateway.core.request_stream import RequestStream

    ctx = zmq.asyncio.Context()
    old = Backend(ctx, deployment_info(requests_endpoint=f"tcp://127.0.0.1:{free_port()}"),
                  key=KEY)
    new = Backend(ctx, deployment_info(deployment_id="d-2",
                                       requests_endpoint=f"tcp://127.0.0.1:{free_port()}"),
                  key=KEY)
    try:
        for cancel in ("released", "aborted"):
            s = RequestStream(old, "r-1", 3)
            if cancel == "released":
                s.released = True
            else:
                s.abort_reason = "abort_all"
            with pytest.raises(Cancelled):
                await new.adopt(s, _generate())
            assert new.streams == {} and s.backend is old
        s = RequestStream(old, "r-2", 3)
        s.abort_reason = "abort_all"
        s.rebind(new, "r-2-r1", 5, 0)
        assert s.abort_reason == "abort_all"
    finally:
        old.close()
        new.close()
        ctx.destroy(linger=0)
