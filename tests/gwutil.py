"""Helpers shared by the gateway tests: free ports, polling with deadlines, an in-process
gateway on a real uvicorn server, SSE reading."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.ports import free_port

__all__ = ["GatewayThread", "GaveUp", "free_port", "poll_until", "sse_lines"]


class GaveUp(AssertionError):
    """Raised by a polled function when waiting longer cannot help (the process it waits
    for exited): `poll_until` fails at once instead of at its deadline."""


def poll_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Call fn until it returns something truthy; fail naming `what` at the deadline
    (or at once if fn raises GaveUp)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except GaveUp:
            raise
        except Exception as exc:  # noqa: BLE001 - keep polling, report the last error
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class GatewayThread:
    """The real gateway app on a real uvicorn server in a thread, on a free port."""

    def __init__(self, settings, key) -> None:
        import uvicorn

        from services.gateway.app import create_app
        from services.gateway.server import GatewayServer

        self.app = create_app(settings, key)
        self.port = settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                             access_log=False, timeout_graceful_shutdown=2)
        self.server = GatewayServer(self.app, cfg)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="gateway")

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()  # for `stuck`: its tasks
            await self.server.serve()
        asyncio.run(serve())

    @property
    def gw(self):
        return self.app.state.gw

    def start(self) -> GatewayThread:
        self.thread.start()
        poll_until(lambda: self.server.started, 20, "the gateway to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), f"gateway thread did not stop\n{self.stuck()}"

    def stuck(self) -> str:
        """Where the gateway's thread is and what its loop still runs: the evidence a
        shutdown that hangs leaves (read racily from this thread: diagnostics only)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        out = ["thread stack:", *(traceback.format_stack(frame) if frame else ["(gone)"])]
        loop = self.loop
        if loop is not None:
            try:
                tasks = list(asyncio.all_tasks(loop))
            except RuntimeError as exc:  # the set changed while read
                tasks, out = [], [*out, f"tasks unreadable: {exc}"]
            for t in tasks:
                out.append(f"task {t.get_name()}: " + " -> ".join(_awaiting(t.get_coro())))
        return "".join(x if x.endswith("\n") else x + "\n" for x in out)


def _awaiting(coro: Any) -> list[str]:
    """A suspended coroutine's await chain, outermost first, as name:line."""
    chain = []
    while coro is not None and len(chain) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_qualname}:{frame.f_lineno}")
        else:
            chain.append(repr(coro))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def sse_lines(resp: httpx.Response):
    """Yield ('data', obj | '[DONE]') and ('comment', text) from an SSE response."""
    for line in resp.iter_lines():
        if not line:
            continue
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("data: "):
            data = line[6:]
            yield "data", data if data == "[DONE]" else json.loads(data)
