"""Fixed raw-TCP garbage for the listeners' ZMTP watch. Whether libzmq reports a failed
handshake depends on the bytes, so tests never draw them at random per run."""

from __future__ import annotations

# Read by libzmq as an unversioned ZMTP 1.0 peer (first byte not 0xFF), then a frame of
# length zero: it closes the connection without any handshake event.
SILENT = b"\x01\x00" + bytes(62)
