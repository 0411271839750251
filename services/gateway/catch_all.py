"""The last line of defence: an exception no route turned into an ApiError.

A pure ASGI middleware (inside Starlette's ServerErrorMiddleware) catches it and, if
the response has not started, answers 500 in its API's shape *without re-raising*, so
uvicorn neither prints a traceback nor closes the keep-alive connection. Each such error
is one log line (type, message, where it was raised), through a `LogLimiter`: a client
that finds a way to cause them cannot fill the disk with tracebacks. Set the log level
to debug to get the full traceback too.
"""

from __future__ import annotations

import logging
import os
import traceback

from starlette.requests import ClientDisconnect

from common.frame_budget import LogLimiter
from services.gateway.core.errors import ApiError, shaped

log = logging.getLogger("lockstep.gateway.errors")


def one_line(exc: BaseException) -> str:
    """`TypeError: message at file.py:42` on one line, printable whatever the message."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    text = str(exc)[:300].encode("utf-8", "backslashreplace").decode().replace("\n", " ")
    return f"{type(exc).__name__}: {text}{where}"


class CatchAll:
    def __init__(self, app, lines: int = 10, period_s: float = 10.0) -> None:
        self.app = app
        self.limiter = LogLimiter(log, lines=lines, period_s=period_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return  # gone while its body was read: nobody to answer, nothing wrong here
        except Exception as exc:  # noqa: BLE001 - this is the catch-all
            self.limiter.warning("internal error on %s %s: %s", scope.get("method"),
                                 scope.get("path"), one_line(exc))
            log.debug("traceback", exc_info=exc)
            if not started:  # else the response is broken anyway: uvicorn closes it
                await shaped(scope.get("path", ""), ApiError(
                    500, f"internal error: {type(exc).__name__}", code="internal"))(
                    scope, receive, send)
