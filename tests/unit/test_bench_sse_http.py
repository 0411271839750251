"""The bench's HTTP reader (bench/sse_http.py) against a real socket server speaking
each framing a measured server uses: chunked (uvicorn), content-length (an error body),
and to-EOF (mlx_lm.server's HTTP/1.0), with chunk borders that split lines."""

from __future__ import annotations

import asyncio

import pytest

from bench.sse_http import HttpError, post_json

EVENTS = b"data: {\"a\": 1}\n\ndata: {\"b\": \"\xc3\xa9\"}\n\ndata: [DONE]\n\n"
WANT = ['data: {"a": 1}', "", 'data: {"b": "é"}', "", "data: [DONE]", ""]


def _chunked(body: bytes, size: int) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def _serve(reply: bytes, seen: list[bytes]):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                .split(b":")[1])
        seen.append(head + await reader.readexactly(n))
        for i in range(0, len(reply), 7):  # dribble: borders fall inside lines and sizes
            writer.write(reply[i:i + 7])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _lines(reply: bytes) -> tuple[int, list[str], list[bytes]]:
    seen: list[bytes] = []
    server, port = await _serve(reply, seen)
    async with server:
        resp = await asyncio.wait_for(post_json(f"http://127.0.0.1:{port}/v1/x?q=1", {"k": "v"}), 10)
        try:
            lines = await asyncio.wait_for(_collect(resp), 10)
        finally:
            resp.close()
    return resp.status, lines, seen


async def _collect(resp) -> list[str]:
    return [line async for line in resp.lines()]


@pytest.mark.parametrize("framing", ["chunked", "eof", "length"])
def test_every_framing_yields_the_same_lines(framing):
    hdr = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    if framing == "chunked":
        reply = hdr + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(EVENTS, 5)
    elif framing == "length":
        reply = hdr + b"Content-Length: %d\r\n\r\n" % len(EVENTS) + EVENTS
    else:
        reply = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + EVENTS
    status, lines, seen = asyncio.run(_lines(reply))
    assert status == 200
    assert lines == WANT
    assert seen[0].startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
    assert seen[0].endswith(b'{"k": "v"}')


def test_an_error_status_and_its_body_are_readable():
    body = b'{"error": {"message": "no"}}'

    async def go():
        seen: list[bytes] = []
        server, port = await _serve(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s"
                                    % (len(body), body), seen)
        async with server:
            resp = await asyncio.wait_for(post_json(f"http://127.0.0.1:{port}/", {}), 10)
            try:
                return resp.status, await asyncio.wait_for(resp.read(), 10)
            finally:
                resp.close()

    status, got = asyncio.run(go())
    assert (status, got) == (400, body)
    assert "HTTP 400" in str(HttpError(status, got))


def test_a_body_cut_short_raises():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(EVENTS, 5)[:-9]
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(_lines(reply))
