"""`python -m bench.mlx_lm_serve ARGS`: exactly `python -m mlx_lm server ARGS`, but listening
with the Lockstep gateway's listen backlog (uvicorn's default, 2048) instead of
socketserver's 5.

Why: at concurrency 32 the benchmark opens 32 connections at once. With a backlog of 5,
some of them are reset about a second later (httpx.ReadError, BrokenResourceError;
measured on the tiny preset: 3 of 32), and the run would die on an accept queue rather
than measure serving. The backlog is the only thing that changes: same argv, same
`mlx_lm.server.main`. bench/servers.py records the value with the server's settings.
"""

from __future__ import annotations

import socketserver
import sys


def listen_backlog() -> int:
    """The Lockstep gateway's: it runs uvicorn with uvicorn.Config's default backlog."""
    import inspect

    import uvicorn

    return int(inspect.signature(uvicorn.Config).parameters["backlog"].default)


def main() -> None:
    # ThreadingHTTPServer (mlx_lm.server's) inherits TCPServer's class attribute.
    socketserver.TCPServer.request_queue_size = listen_backlog()
    from mlx_lm.server import main as serve

    sys.argv[0] = "mlx_lm.server"
    serve()


if __name__ == "__main__":
    main()
