"""One entry of the prompt cache's disk tier (services/rank/disk_tier.py), as files: the
sidecar `<key>.json` = {"v", "key", "tokens", "bytes", "mac"} beside `<key>.safetensors`,
the MAC that binds them, reading and verifying both, and rebuilding the cache from the
verified bytes. No threads and no index here: the tier decides when."""

from __future__ import annotations

import enum
import hashlib
import hmac
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache

from services.rank.kv_format import lp, token_bytes

FORMAT_VERSION = 1
MAC_DOMAIN = b"lockstep-kv/v1"
KEY_RE = re.compile(r"[0-9a-f]{32}")
SIDECAR_MAX = 256 << 20


class Reject(enum.Enum):
    """Why an entry was refused; its files are removed (unless DISABLED or BAD_KEY)."""
    DISABLED = "the disk tier is off"
    BAD_KEY = "not an entry key"
    MISSING = "no such entry"
    IO = "entry unreadable"
    ORPHAN = "half an entry (data without sidecar or sidecar without data)"
    SIDECAR = "sidecar missing fields or unparsable"
    KEY_MISMATCH = "the tokens do not hash to the key"
    SIZE = "file size differs from the sidecar's (truncated?)"
    MAC = "MAC mismatch (corrupt, or made for another model, placement, rank or cache key)"
    TOKENS = "token count differs from the plan's"
    FORMAT = "cache layout unreadable"


class DiskEntryError(Exception):
    """A load that cannot be trusted or read."""

    def __init__(self, key: str, reason: Reject, detail: str = "") -> None:
        super().__init__(f"disk cache entry {key}: {reason.value}" + (f" ({detail})" if detail else ""))
        self.key, self.reason = key, reason


@dataclass
class DiskEntry:
    key: str
    tokens: list[int]
    nbytes: int  # size of the .safetensors file
    used_at: float  # its mtime: LRU order survives restarts


class EntryMac:
    """HMAC-SHA256 under the cache key over an entry's key, token count, tokens and data,
    bound to the model, the placement and the rank: a file made for any other is refused."""

    def __init__(self, key: bytes, fingerprint: str, placement: str, rank: int) -> None:
        self._base = hmac.new(key, MAC_DOMAIN + lp(fingerprint) + lp(placement)
                              + lp(str(rank)), hashlib.sha256)

    def of(self, key: str, n_tokens: int, tokens_bytes: bytes, data_digest: bytes) -> str:
        m = self._base.copy()
        m.update(lp(key) + lp(str(n_tokens)) + hashlib.sha256(tokens_bytes).digest()
                 + data_digest)
        return m.hexdigest()


def sidecar(key: str, tokens: list[int], nbytes: int, mac: str) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "key": key, "tokens": list(tokens),
                       "bytes": nbytes, "mac": mac}).encode()


def read_entry(folder: Path, key: str, macs: EntryMac) -> tuple[list[int], bytes, float]:
    """An entry's tokens, its data file read once into memory and checked against the
    sidecar's MAC, and the data's mtime. Raises DiskEntryError."""
    if not KEY_RE.fullmatch(key):
        raise DiskEntryError(key, Reject.BAD_KEY)
    side, path = folder / f"{key}.json", folder / f"{key}.safetensors"
    try:
        if side.stat().st_size > SIDECAR_MAX:
            raise DiskEntryError(key, Reject.SIDECAR, "too large")
        d = json.loads(side.read_bytes())
        tokens, nbytes, mac = d["tokens"], d["bytes"], d["mac"]
        if not (d["v"] == FORMAT_VERSION and d["key"] == key and isinstance(mac, str)
                and type(nbytes) is int and isinstance(tokens, list)
                and all(type(t) is int for t in tokens)):
            raise ValueError("a field of the wrong type or value")
        tb = token_bytes(tokens)
    except FileNotFoundError:
        raise DiskEntryError(key, Reject.ORPHAN if path.exists() else Reject.MISSING) from None
    except OSError as e:
        raise DiskEntryError(key, Reject.IO, str(e)) from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise DiskEntryError(key, Reject.SIDECAR, str(e)) from None
    if hashlib.sha256(tb).hexdigest()[:32] != key:
        raise DiskEntryError(key, Reject.KEY_MISMATCH)
    try:
        with open(path, "rb") as f:
            data, mtime = f.read(), os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        raise DiskEntryError(key, Reject.ORPHAN, "sidecar without data") from None
    except OSError as e:
        raise DiskEntryError(key, Reject.IO, str(e)) from None
    if len(data) != nbytes:
        raise DiskEntryError(key, Reject.SIZE, f"{len(data)} bytes, sidecar says {nbytes}")
    if not hmac.compare_digest(macs.of(key, len(tokens), tb, hashlib.sha256(data).digest()), mac):
        raise DiskEntryError(key, Reject.MAC)
    return tokens, data, mtime


def parse(key: str, data: bytes, n_tokens: int) -> list:
    """load_prompt_cache's rebuilding, from verified bytes in memory (mx.load reads a
    file-like object), with class names only from mlx-lm's cache module."""
    try:
        arrays, meta = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
        mx.eval(list(arrays.values()))  # copied out now, from the verified bytes
        if meta.get("0.lockstep_key") != key or meta.get("0.n_tokens") != str(n_tokens):
            raise ValueError("the metadata names another entry")
        _, classes, scalars = tree_unflatten(list(meta.items()))
        for pos, kind in scalars[1:]:
            a = arrays[pos]
            arrays[pos] = (a.item() if kind == "scalar" else None if kind == "none"
                           else "".join(map(chr, a.tolist())) if kind == "string"
                           else _bad(kind))
        cache = []
        for name, state in zip(classes, tree_unflatten(list(arrays.items())), strict=True):
            cls = getattr(mlx_cache, name, None)
            if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache)):
                raise ValueError(f"unknown cache class {name!r}")
            cache.append(cls.from_state(state))
        return cache
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise DiskEntryError(key, Reject.FORMAT, str(e)) from None


def _bad(kind: str):
    raise ValueError(f"unknown scalar kind {kind!r}")
