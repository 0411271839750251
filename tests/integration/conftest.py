"""Fixtures of the bus tests on real sockets (tests/integration/test_bus_*.py): each
runs once over loopback tcp and once over ipc."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest
import zmq
import zmq.asyncio

from common.bus import Channel
from common.rpc_client import AsyncRpcClient
from tests.support.bus import RouterServer, client_channel
from tests.support.ports import free_port

TRANSPORTS = ["tcp", "ipc"]


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="ls-", dir="/tmp")  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture
def endpoints(transport, ipc_dir):
    """endpoints(name) -> a fresh endpoint of this test's transport, not yet bound."""
    def make(name: str) -> str:
        if transport == "tcp":
            return f"tcp://127.0.0.1:{free_port()}"
        return f"ipc://{ipc_dir}/{name}"
    return make



@pytest.fixture
def servers():
    made: list[RouterServer] = []

    def start(endpoint: str, **kw) -> RouterServer:
        s = RouterServer(endpoint, **kw)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


@pytest.fixture
async def actx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def sctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def aclients(actx):
    made: list[AsyncRpcClient] = []

    def make(endpoint: str, channel: Channel | None = None) -> AsyncRpcClient:
        c = AsyncRpcClient(actx, endpoint, channel or client_channel())
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    await asyncio.sleep(0)
