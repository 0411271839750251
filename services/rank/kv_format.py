"""What a disk-tier entry is on disk, apart from trust (services/rank/disk_tier.py): the
safetensors bytes of an mlx-lm prompt cache in `save_prompt_cache`'s layout, made from
evaluated arrays with numpy and buffers only (the writer thread runs no MLX op); the
entry key (a hash of the tokens, the same on every rank and across launches); the
placement's folder name; and the model fingerprint (config, weight index, weight file
names, sizes and safetensors headers — never the weights).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

_HEADER_MAX = 100 << 20
_DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32",
           mx.uint64: "U64", mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64",
           mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.complex64: "C64"}


def lp(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(2, "big") + b


def token_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def entry_key(tokens) -> str:
    return hashlib.sha256(token_bytes(tokens)).hexdigest()[:32]


def placement_name(replica: int, tp: int, pp: int, rank: int) -> str:
    return f"r{replica}-tp{tp}-pp{pp}-rank{rank}"

def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > _HEADER_MAX:
            raise ValueError(f"{path}: safetensors header of {n} bytes")
        return f.read(n)  # the header only, never the weights


def model_fingerprint(model_dir: Path) -> str:
    """16 hex chars naming the model's config and weights, from headers and sizes only."""
    d, h = Path(model_dir), hashlib.sha256()

    def part(tag: str, data: bytes) -> None:  # length-prefixed: no two inputs collide
        h.update(lp(tag) + len(data).to_bytes(8, "big") + data)

    part("config", (d / "config.json").read_bytes())
    if (d / "model.safetensors.index.json").is_file():
        part("index", (d / "model.safetensors.index.json").read_bytes())
    if (d / "tokenizer.json").is_file():
        part("tokenizer-size", str((d / "tokenizer.json").stat().st_size).encode())
    for p in sorted(d.glob("*.safetensors"), key=lambda p: p.name):
        part("weights", f"{p.name}\0{p.stat().st_size}".encode())
        part("header", _safetensors_header(p))
    return h.hexdigest()[:16]


# -- encoding (writer thread: numpy and buffers only, no MLX op) ---------------------------

def layout(cache: list) -> tuple[list, dict[str, int], list[str]]:
    """save_prompt_cache's flattening of `[c.state for c in cache]`: (name, array or scalar)
    pairs, the rows to keep of KVCache buffers (larger than offset), the class names."""
    items, rows = [], {}
    for i, c in enumerate(cache):
        if type(c) is mlx_cache.KVCache and c.keys is not None:  # fast path, no tree walk
            items += [(f"{i}.0", c.keys), (f"{i}.1", c.values), (f"{i}.2", c.offset)]
            rows[f"{i}.0"] = rows[f"{i}.1"] = c.offset
        else:
            items += tree_flatten(c.state, prefix=f".{i}")
    return items, rows, [type(c).__name__ for c in cache]


def _raw(a: mx.array, rows: int | None) -> np.ndarray:
    """The bytes of an evaluated array as uint8 (..., last*itemsize), cut to `rows` on axis -2.
    A non-contiguous array (a slice view) is copied once, by memoryview.tobytes under the
    GIL; the KV the store keeps (BatchKVCache.extract, update_and_fetch buffers) is not one."""
    if a.size == 0:
        return np.empty(0, np.uint8)
    m = memoryview(a)  # available already: a pure read (bfloat16 has no numpy dtype, bytes do)
    flat = np.frombuffer(m if m.c_contiguous else m.tobytes(), np.uint8)
    if a.ndim == 0:
        return flat
    v = flat.reshape(*a.shape[:-1], a.shape[-1] * a.itemsize)
    return v if rows is None else v[..., :rows, :]


def _scalar(v) -> tuple[np.ndarray, str, list[int], str]:
    """How save_prompt_cache stores a non-array state value (via mx.array)."""
    if isinstance(v, bool):
        return np.array(v, np.bool_), "BOOL", [], "scalar"
    if isinstance(v, int):
        small = -(1 << 31) <= v < (1 << 31)
        return np.array(v, "<i4" if small else "<i8"), "I32" if small else "I64", [], "scalar"
    if isinstance(v, float):
        return np.array(v, "<f4"), "F32", [], "scalar"
    if isinstance(v, str):
        return np.array([ord(ch) for ch in v], "<i4"), "I32", [len(v)], "string"
    if v is None:
        return np.empty(0, "<f4"), "F32", [0], "none"
    raise ValueError(f"cache state is not serializable: {type(v).__name__}")


def encode(items, rows, classes, meta: dict[str, str]) -> list:
    header, blobs, off, scalars = {}, [], 0, [""]
    for name, v in items:
        if isinstance(v, mx.array):
            if v.dtype not in _DTYPES:
                raise ValueError(f"cache array {name} has dtype {v.dtype}, not in safetensors")
            raw, dt, shape = _raw(v, rows.get(name)), _DTYPES[v.dtype], list(v.shape)
            if name in rows:
                shape[-2] = rows[name]
        else:
            arr, dt, shape, kind = _scalar(v)
            raw = arr.reshape(-1).view(np.uint8)
            scalars.append((name, kind))
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + raw.nbytes]}
        off += raw.nbytes
        blobs.append(raw)
    md = dict(tree_flatten([meta, classes, scalars]))
    head = json.dumps({"__metadata__": md, **header}, separators=(",", ":")).encode()
    return [len(head).to_bytes(8, "little"), head, *blobs]


def write_blobs(f, blobs: list, h) -> None:
    """Writes (and hashes) each blob in C-contiguous pieces: a KVCache cut to offset is not."""
    for b in blobs:
        if isinstance(b, bytes) or b.flags.c_contiguous:
            f.write(b)
            if h is not None:
                h.update(b)
        else:
            write_blobs(f, list(b), h)
