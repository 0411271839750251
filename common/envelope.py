"""The signed envelope: every byte on the bus goes through `Signer` and `Verifier`.

Wire layout of one frame:

    prefix  ">2sB8sH"  magic b"LS", protocol version, key id (8 bytes), header length
    header  msgpack [kind, sender, boot_id, seq, timestamp]
    body    msgpack map, the kind's schema
    mac     HMAC-SHA256(key, prefix + header + body), 32 bytes

The MAC is checked with `hmac.compare_digest` before header or body is decoded;
only the fixed-width prefix is read first, to pick the key. Decoding raises only
`Rejected` (with a `Reason`), and every rejection is counted.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import os
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from common.messages import BODY, KIND_OF, Kind
from common.schema import SchemaError, decode_into, wire_default

MAGIC = b"LS"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct(">2sB8sH")
MAC_LEN = 32
MIN_LEN = PREFIX.size + MAC_LEN + 2
DEFAULT_MAX_SIZE = 4 * 1024 * 1024
DEFAULT_SKEW_S = 30.0
REPLAY_WINDOW = 1024  # out-of-order tolerance per sender (threads share one counter)
MAX_SENDERS = 4096

# One boot id per process; each Signer extends it with its own suffix and counter, so
# a recreated socket (Lazy Pirate) or a restarted process is a new (sender, boot) and
# a subscriber can see gaps in one publisher's sequence.
BOOT_ID = secrets.token_hex(8)
_KINDS: dict[str, Kind] = {k.value: k for k in Kind}


class Reason(str, enum.Enum):
    TOO_SHORT = "too_short"
    OVERSIZE = "oversize"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    UNKNOWN_KEY = "unknown_key"
    BAD_MAC = "bad_mac"
    BAD_HEADER = "bad_header"
    UNKNOWN_KIND = "unknown_kind"
    UNEXPECTED_KIND = "unexpected_kind"
    STALE = "stale"
    FUTURE = "future"
    REPLAY = "replay"
    BAD_BODY = "bad_body"
    MISSING_FIELD = "missing_field"
    EXTRA_FIELD = "extra_field"
    WRONG_TYPE = "wrong_type"
    FIELD_TOO_LARGE = "field_too_large"
    BAD_FRAMES = "bad_frames"
    UNAUTHENTICATED = "unauthenticated"  # not from an identity that completed the handshake
    WRONG_PEER = "wrong_peer"  # an authenticated identity speaking for another rank
    # Session handshake (common/handshake.py)
    BAD_PROOF = "bad_proof"  # challenge-response proof does not verify
    BAD_NONCE = "bad_nonce"
    BAD_RANK = "bad_rank"  # a rank this responder does not serve
    WRONG_LAUNCH = "wrong_launch"  # hello names another deployment or job
    DUPLICATE_RANK = "duplicate_rank"  # that rank is already authenticated elsewhere
    NO_HANDSHAKE = "no_handshake"  # a proof for no challenge we issued (a bad cookie)
    HANDSHAKE_EXPIRED = "handshake_expired"  # a proof past its challenge's deadline
    RETIRED_KEY = "retired_key"  # signed with the key of a launch that has ended
    # Transport (common/zmtp_watch.py): a connection libzmq closed before the ZMTP
    # handshake completed (raw bytes, not ZeroMQ, or silent past the handshake timeout).
    NO_ZMTP = "no_zmtp"


class Rejected(Exception):
    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Key:
    secret: bytes
    key_id: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> Key:
        if len(secret) < 16:
            raise ValueError("key too short (need >= 16 bytes)")
        kid = hmac.new(secret, b"lockstep key id", hashlib.sha256).digest()[:8]
        return cls(secret, kid)

    def __repr__(self) -> str:  # never print the secret
        return f"Key(id={self.key_id.hex()})"


@dataclass(frozen=True)
class Header:
    kind: Kind
    sender: str
    boot: str
    seq: int
    ts: float
    key_id: bytes


@dataclass(frozen=True)
class Message:
    header: Header
    body: Any

    @property
    def kind(self) -> Kind:
        return self.header.kind


class Signer:
    """Signs bodies as one sender; thread-safe (the counter is per process)."""

    def __init__(self, key: Key, sender: str, *, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.sender = sender
        self.boot = f"{BOOT_ID}.{secrets.token_hex(3)}"
        self._clock = clock
        self._mac = hmac.new(key.secret, digestmod=hashlib.sha256)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def encode(self, body: Any, *, seq: int | None = None, ts: float | None = None) -> bytes:
        kind = KIND_OF[type(body)]
        header = msgpack.packb(
            [kind.value, self.sender, self.boot, self.next_seq() if seq is None else seq,
             self._clock() if ts is None else ts]
        )
        payload = msgpack.packb(body, default=wire_default)
        prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, self.key.key_id, len(header))
        mac = self._mac.copy()
        mac.update(prefix)
        mac.update(header)
        mac.update(payload)
        return b"".join((prefix, header, payload, mac.digest()))


class RejectCounter:
    """Counts rejections by reason; shared registry feeds /metrics and status."""

    def __init__(self, service: str, socket: str) -> None:
        self.service = service
        self.socket = socket
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        REGISTRY.add(self)

    def add(self, reason: Reason) -> None:
        with self._lock:
            self.counts[reason.value] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _Registry:
    def __init__(self) -> None:
        self._counters: list[RejectCounter] = []
        self._lock = threading.Lock()

    def add(self, c: RejectCounter) -> None:
        with self._lock:
            self._counters.append(c)

    def snapshot(self) -> list[dict[str, Any]]:
        """[{service, socket, reason, count}] summed over counters with equal labels."""
        total: Counter[tuple[str, str, str]] = Counter()
        with self._lock:
            counters = list(self._counters)
        for c in counters:
            for reason, n in c.snapshot().items():
                total[(c.service, c.socket, reason)] += n
        return [{"service": s, "socket": k, "reason": r, "count": n} for (s, k, r), n in sorted(total.items())]


REGISTRY = _Registry()


class ReplayWindow:
    """Per (sender, boot): highest sequence plus a bitmap of the last REPLAY_WINDOW."""

    def __init__(self, size: int = REPLAY_WINDOW, max_senders: int = MAX_SENDERS) -> None:
        self.size = size
        self.max_senders = max_senders
        self._state: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def check_and_record(self, sender: str, boot: str, seq: int) -> bool:
        key = (sender, boot)
        with self._lock:
            st = self._state.get(key)
            if st is None:
                if len(self._state) >= self.max_senders:
                    self._state.popitem(last=False)
                self._state[key] = [seq, 1]
                return True
            self._state.move_to_end(key)
            highest, bits = st
            if seq > highest:
                shift = seq - highest
                bits = ((bits << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
                st[0], st[1] = seq, bits
                return True
            offset = highest - seq
            if offset >= self.size or (bits >> offset) & 1:
                return False
            st[1] = bits | (1 << offset)
            return True


class Verifier:
    """Checks and decodes frames for one receiving socket."""

    def __init__(
        self,
        keys: Iterable[Key],
        accept: Iterable[Kind],
        counter: RejectCounter,
        *,
        max_size: int = DEFAULT_MAX_SIZE,
        skew_s: float = DEFAULT_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._macs = {k.key_id: hmac.new(k.secret, digestmod=hashlib.sha256) for k in keys}
        if not self._macs:
            raise ValueError("a verifier needs at least one key (fail closed)")
        self.accept = frozenset(accept)
        self.counter = counter
        self.max_size = max_size
        self.skew_s = skew_s
        self._clock = clock
        self.window = ReplayWindow()

    def decode(self, data: bytes) -> Message:
        try:
            return self._decode(data)
        except Rejected as exc:
            self.counter.add(exc.reason)
            raise

    def _decode(self, data: bytes) -> Message:
        if type(data) is not bytes:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise Rejected(Reason.BAD_FRAMES, "not bytes")
            data = bytes(data)
        n = len(data)
        if n > self.max_size:
            raise Rejected(Reason.OVERSIZE, f"{n} bytes")
        if n < MIN_LEN:
            raise Rejected(Reason.TOO_SHORT, f"{n} bytes")
        magic, version, key_id, header_len = PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise Rejected(Reason.BAD_MAGIC)
        if version != PROTOCOL_VERSION:
            raise Rejected(Reason.BAD_VERSION, str(version))
        base = self._macs.get(key_id)
        if base is None:
            raise Rejected(Reason.UNKNOWN_KEY, key_id.hex())
        mac = base.copy()
        mac.update(memoryview(data)[: n - MAC_LEN])
        if not hmac.compare_digest(mac.digest(), data[n - MAC_LEN :]):
            raise Rejected(Reason.BAD_MAC)
        # Authenticated from here on: decode header, then body.
        body_start = PREFIX.size + header_len
        if body_start > n - MAC_LEN:
            raise Rejected(Reason.BAD_HEADER, "header length")
        try:
            hdr = msgpack.unpackb(data[PREFIX.size : body_start], raw=False, max_array_len=8,
                                  max_str_len=256, max_map_len=0, max_bin_len=0)
        except Exception as exc:  # noqa: BLE001 - any unpack error is a reject
            raise Rejected(Reason.BAD_HEADER, type(exc).__name__) from None
        if (type(hdr) is not list or len(hdr) != 5 or type(hdr[0]) is not str
                or type(hdr[1]) is not str or type(hdr[2]) is not str
                or type(hdr[3]) is not int or type(hdr[4]) not in (int, float)):
            raise Rejected(Reason.BAD_HEADER, "shape")
        kind_s, sender, boot, seq, ts = hdr
        kind = _KINDS.get(kind_s)
        if kind is None:
            raise Rejected(Reason.UNKNOWN_KIND, kind_s[:64])
        if kind not in self.accept:
            raise Rejected(Reason.UNEXPECTED_KIND, kind.value)
        now = self._clock()
        if not ts >= now - self.skew_s:  # NaN counts as stale
            raise Rejected(Reason.STALE, f"{now - ts:.1f}s old")
        if ts > now + self.skew_s:
            raise Rejected(Reason.FUTURE, f"{ts - now:.1f}s ahead")
        try:
            raw = msgpack.unpackb(data[body_start : n - MAC_LEN], raw=False, strict_map_key=True,
                                  max_str_len=self.max_size, max_bin_len=self.max_size,
                                  max_array_len=self.max_size, max_map_len=65536, max_ext_len=0)
        except Exception as exc:  # noqa: BLE001
            raise Rejected(Reason.BAD_BODY, type(exc).__name__) from None
        try:
            body = decode_into(BODY[kind], raw)
        except SchemaError as exc:
            raise Rejected(Reason(exc.reason), exc.detail) from None
        except (TypeError, ValueError, RecursionError) as exc:
            raise Rejected(Reason.BAD_BODY, type(exc).__name__) from None
        # Replay is recorded last so a forged-body frame can't burn a sequence number.
        if not self.window.check_and_record(sender, boot, seq):
            raise Rejected(Reason.REPLAY, f"{sender} seq {seq}")
        return Message(Header(kind, sender, boot, seq, float(ts), key_id), body)


def random_id(prefix: str = "") -> str:
    return prefix + secrets.token_hex(8)


def process_tag() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"
