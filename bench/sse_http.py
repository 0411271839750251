"""A minimal HTTP/1.1 client for one streamed POST: the bench's measuring instrument.

Why not httpx: on this 2-core machine the bench client shares the CPU with the server it
measures, and httpx's layers (httpcore, anyio, h11) cost ~570 µs of client CPU per
streamed token (bench/results/gateway.json, tiny preset, c=1) — CPU taken from the
server under test, and the in-process baseline has no client at all. This reader does
one connection per request (`Connection: close`), reads the status line and headers,
then the body as it comes: chunked (uvicorn), content-length, or to EOF (mlx_lm.server
speaks HTTP/1.0), and yields its lines. The same code measures every server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 65536


class HttpError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class Response:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 status: int, headers: dict[str, str]) -> None:
        self.reader, self.writer = reader, writer
        self.status = status
        self.headers = headers

    async def _body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, framing removed."""
        r = self.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await r.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    await r.readuntil(b"\r\n")  # the (empty) trailer ends the body
                    return
                data = await r.readexactly(size)
                await r.readexactly(2)
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await r.read(min(left, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                yield data
        else:  # HTTP/1.0 style: the body ends when the server closes
            while data := await r.read(65536):
                yield data

    async def lines(self) -> AsyncIterator[str]:
        buf = b""
        async for data in self._body():
            buf += data
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.rstrip(b"\r").decode()

    async def read(self) -> bytes:
        return b"".join([d async for d in self._body()])

    def close(self) -> None:
        self.writer.close()


async def post_json(url: str, body: dict, timeout: float = 30.0) -> Response:
    """Send `body` as a JSON POST to `url`; the response once its headers are in (the
    caller reads the body and closes it)."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    payload = json.dumps(body).encode()
    target = u.path + (f"?{u.query}" if u.query else "")
    head = (f"POST {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    writer.write(head + payload)
    await writer.drain()
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        writer.close()
        raise HttpError(0, b"response headers too long") from None
    if len(raw) > MAX_HEADER_BYTES:
        writer.close()
        raise HttpError(0, b"response headers too long")
    status_line, *header_lines = raw.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        writer.close()
        raise HttpError(0, status_line.encode())
    headers = {}
    for h in header_lines:
        if ":" in h:
            k, v = h.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return Response(reader, writer, int(parts[1]), headers)
