"""One rank's on-disk tier of the prompt cache: it writes, verifies, loads and drops entries
when rank 0's plan says so, and never decides what to keep.

`<root>/<model fingerprint>/<placement>/` holds, per entry, `<key>.safetensors` (the layout
mlx-lm's `save_prompt_cache` writes, so `load_prompt_cache` reads our files) and the
sidecar `<key>.json` = {"v", "key", "tokens", "bytes", "mac"}. Each is written to a temp
name, fsynced and renamed, the sidecar last, so a crash leaves at most a temp file or data
without a sidecar, both removed by `scan`. The MAC (HMAC-SHA256 under the cache key) binds
the file bytes to the tokens, the model, the placement and the rank: a flipped bit or a file
from another model, placement, rank or key is refused, never parsed (one entry's files:
services/rank/disk_entry.py).

Threads. `write()` runs on the MLX step thread: it evaluates the entry's arrays there (free
when they are evaluated already; a lazy entry, e.g. fresh from BatchKVCache.extract, is
computed there, ~70 ms per 100 MB on CPU) and queues references to them. One writer thread turns them
into bytes through the buffer protocol and does all the file work, with no MLX op: in mlx
0.32 an array built on one thread cannot be evaluated on another ("There is no Stream(cpu, 0)
in current thread", tests/unit/test_disk_tier.py keeps the experiment), and
`array::wait()`/`is_available()` update an array's event and status without a lock, so two
threads waiting on one array race. Reading an available array's buffer changes nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import secrets
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from services.rank.disk_entry import (
    KEY_RE,
    DiskEntry,
    DiskEntryError,
    EntryMac,
    Reject,
    parse,
    read_entry,
    sidecar,
)
from services.rank.kv_format import encode as _encode
from services.rank.kv_format import entry_key, model_fingerprint, placement_name
from services.rank.kv_format import layout as _layout
from services.rank.kv_format import token_bytes as _token_bytes
from services.rank.kv_format import write_blobs as _write_blobs

__all__ = ["DiskEntry", "DiskEntryError", "DiskStats", "DiskTier", "Reject", "entry_key",
           "model_fingerprint", "placement_name"]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a single safe path component
_TMP = ".tmp"


@dataclass
class DiskStats:
    entries: int
    bytes: int
    written: int
    write_errors: int
    rejected: int
    loaded: int
    dropped: int


def _unlink(p: Path) -> bool:
    try:
        p.unlink()
        return True
    except FileNotFoundError:
        return False


def _mkdirs(folder: Path) -> None:
    for p in reversed([folder, *folder.parents]):  # 0700, the parents we make too
        if not p.is_dir():
            try:
                p.mkdir(mode=0o700)
            except FileExistsError:  # another rank of this host made it meanwhile
                if not p.is_dir():
                    raise  # a file in the way


class DiskTier:
    def __init__(self, root: Path, fingerprint: str, placement: str, rank: int,
                 key: bytes) -> None:
        for name in (fingerprint, placement):
            if not _NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a safe folder name")
        self.folder = Path(root) / fingerprint / placement
        self.enabled = False
        self.pending: dict[str, tuple[list[int], list]] = {}
        self._macs = EntryMac(key, fingerprint, placement, rank)
        self._lock = threading.Lock()  # pending, failed, index, counters
        self._io = threading.Lock()  # one writer task or one scan at a time
        self._cv = threading.Condition()  # the task queue
        self._tasks: deque = deque()
        self._busy = 0  # tasks queued or running
        self._stop = self._warned = False
        self._failed: list[str] = []
        self._index: dict[str, DiskEntry] = {}
        self._n = dict(written=0, write_errors=0, rejected=0, loaded=0, dropped=0)
        if not key:  # fail closed: without a key nothing on disk can be trusted
            log.warning("prompt cache disk tier off for %s: no cache key", self.folder)
            return
        try:
            _mkdirs(self.folder)
            fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("prompt cache disk tier off: cannot create %s: %s", self.folder, e)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            log.warning("prompt cache disk tier off: %s is locked by another process (%s)",
                        self.folder, e)
            return
        self._lock_fd, self.enabled = fd, True
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # -- the step thread's calls -----------------------------------------------------------

    def write(self, key: str, tokens: list[int], cache: list) -> None:
        """Queue `cache` for disk (neither it nor `tokens` may change afterwards). Here it
        costs O(layers); the arrays are evaluated here, free when they are already."""
        if not self.enabled:
            return
        if not KEY_RE.fullmatch(key):
            raise ValueError(f"{key!r} is not an entry key")
        items, rows, classes = _layout(cache)
        mx.eval([v for _, v in items if isinstance(v, mx.array)])
        item = (tokens, cache)
        with self._lock:
            self.pending[key] = item
        self._put(self._do_write, key, item, items, rows, classes)

    def load(self, key: str, n_tokens: int) -> list:
        if not self.enabled:
            raise DiskEntryError(key, Reject.DISABLED)
        if not KEY_RE.fullmatch(key):
            raise DiskEntryError(key, Reject.BAD_KEY)
        with self._lock:
            item = self.pending.get(key)
            if item is not None and len(item[0]) == n_tokens:
                self._n["loaded"] += 1
                return item[1]
        if item is not None:  # a planner bug, not a bad file: nothing to remove
            raise DiskEntryError(key, Reject.TOKENS, f"{len(item[0])} pending, plan says {n_tokens}")
        try:
            tokens, data, _ = read_entry(self.folder, key, self._macs)
            if len(tokens) != n_tokens:
                raise DiskEntryError(key, Reject.TOKENS, f"{len(tokens)} on disk, plan says {n_tokens}")
            cache = parse(key, data, n_tokens)  # the very bytes the MAC covered
        except DiskEntryError as e:
            self._reject(e)
            raise
        self._touch(key)
        with self._lock:
            self._n["loaded"] += 1
        return cache

    def drop(self, key: str) -> None:
        if not KEY_RE.fullmatch(key):
            raise ValueError(f"{key!r} is not an entry key")  # it names files
        with self._lock:
            self.pending.pop(key, None)
            self._failed = [k for k in self._failed if k != key]
        if self.enabled:
            self._put(self._do_drop, key)  # behind any queued write of it: the drop wins

    def clear(self) -> None:
        with self._lock:
            self.pending.clear()
            self._failed.clear()
        if self.enabled:
            self._put(self._do_clear)

    def touch(self, key: str) -> None:
        if self.enabled and KEY_RE.fullmatch(key):
            self._put(self._touch, key)

    def take_failed(self) -> list[str]:
        with self._lock:
            out, self._failed = self._failed, []
        return out

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(entries=len(self._index),
                             bytes=sum(e.nbytes for e in self._index.values()), **self._n)

    def flush(self, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        if not self.enabled:
            return
        done = self.flush(timeout)
        with self._cv:  # what is still queued is dropped: it was in memory only
            self._stop = True
            self._busy -= len(self._tasks)
            self._tasks.clear()
            self._cv.notify_all()
        self._thread.join(timeout=max(timeout, 0.1))
        if not done:
            log.warning("prompt cache disk tier %s closed with writes unfinished", self.folder)
        self.enabled = False
        os.close(self._lock_fd)  # releases the flock

    # -- verification ----------------------------------------------------------------------

    def scan(self) -> dict[str, DiskEntry]:
        """Boot: verify every entry fully, remove what fails; the good ones by key."""
        if not self.enabled:
            return {}
        found: dict[str, DiskEntry] = {}
        with self._io:
            names = os.listdir(self.folder)
            for n in names:
                if n.endswith(_TMP):
                    _unlink(self.folder / n)
            keys = {n.rsplit(".", 1)[0] for n in names if n.endswith((".safetensors", ".json"))}
            for k in sorted(keys):
                try:
                    tokens, data, mtime = read_entry(self.folder, k, self._macs)
                    found[k] = DiskEntry(k, tokens, len(data), mtime)
                except DiskEntryError as e:
                    self._reject(e)
            with self._lock:
                self._index = dict(found)
        return found

    def _reject(self, e: DiskEntryError) -> None:
        if e.reason in (Reject.DISABLED, Reject.BAD_KEY):
            return
        self._remove(e.key)
        with self._lock:
            self._index.pop(e.key, None)
            self._n["rejected"] += 1
        log.warning("prompt cache disk tier %s: refused: %s", self.folder, e)

    def _remove(self, key: str) -> bool:
        gone = [_unlink(self.folder / f"{key}.{s}") for s in ("json", "safetensors")]
        return any(gone)  # the sidecar first: a crash between leaves an orphan, not a lie

    def _touch(self, key: str) -> None:
        path = self.folder / f"{key}.safetensors"
        try:
            os.utime(path)
            mtime = path.stat().st_mtime
        except OSError:
            return  # best effort: only LRU order suffers
        with self._lock:
            if key in self._index:
                self._index[key].used_at = mtime

    # -- the writer thread -----------------------------------------------------------------

    def _put(self, fn, *args) -> None:
        with self._cv:
            self._tasks.append((fn, args))
            self._busy += 1
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._tasks or self._stop)
                if self._stop:
                    return
                fn, args = self._tasks.popleft()
            try:
                with self._io:
                    fn(*args)
            except Exception as e:  # the thread outlives any one task
                self._warn(f"{fn.__name__} failed: {e}")
            finally:
                del fn, args  # release the entry's arrays now, not at the next task
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _warn(self, what: str) -> None:
        log.log(logging.DEBUG if self._warned else logging.WARNING,
                "prompt cache disk tier %s: %s", self.folder, what)
        self._warned = True

    def _do_write(self, key: str, item: tuple, items: list, rows: dict, classes: list) -> None:
        with self._lock:
            if self.pending.get(key) is not item:
                return  # dropped, cleared or written again since
        tokens = item[0]
        try:
            tb = _token_bytes(tokens)
            if hashlib.sha256(tb).hexdigest()[:32] != key:
                raise ValueError("the key is not its tokens' entry_key")
            meta = {"lockstep_key": key, "n_tokens": str(len(tokens))}
            path, h = self.folder / f"{key}.safetensors", hashlib.sha256()
            self._durable(path, _encode(items, rows, classes, meta), h)
            st = path.stat()
            mac = self._macs.of(key, len(tokens), tb, h.digest())
            self._durable(self.folder / f"{key}.json", [sidecar(key, tokens, st.st_size, mac)],
                          None)
            dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)  # the renames, too, survive a crash
            finally:
                os.close(dfd)
        except Exception as e:  # ENOSPC, EACCES, EROFS, EDQUOT, ... or a bad entry
            self._remove(key)
            with self._lock:
                self._index.pop(key, None)
                self._n["write_errors"] += 1
                if self.pending.get(key) is item:
                    self._failed.append(key)  # stays in pending until the planner drops it
            self._warn(f"writing entry {key} failed: {e}")
            return
        with self._lock:
            self._index[key] = DiskEntry(key, list(tokens), st.st_size, st.st_mtime)
            self._n["written"] += 1
            if self.pending.get(key) is item:
                del self.pending[key]

    def _durable(self, path: Path, blobs: list, h) -> None:
        tmp = self.folder / f".{path.name}.{secrets.token_hex(4)}{_TMP}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                _write_blobs(f, blobs, h)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def _do_drop(self, key: str) -> None:
        gone = self._remove(key)
        with self._lock:
            if self._index.pop(key, None) is not None or gone:
                self._n["dropped"] += 1

    def _do_clear(self) -> None:
        keys = set()
        for n in os.listdir(self.folder):
            if n.endswith(_TMP):
                _unlink(self.folder / n)
            elif n.endswith((".safetensors", ".json")) and _unlink(self.folder / n):
                keys.add(n.rsplit(".", 1)[0])
        with self._lock:
            self._n["dropped"] += len(keys | set(self._index))
            self._index.clear()
