"""Opening this rank's disk tier at start-up (services/rank/disk_tier.py), from its spec:
the folder under its own home for the model and placement, the key the supervisor
handed over with the launch, and the start-up scan (every file's MAC checked).

A tier that cannot open (no key, the folder taken by another launch, an unreadable
disk) leaves this rank memory-only: it says so to rank 0 (DISK_INDEX off), which then
writes nothing through on any rank.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from common.keys import KeyFileError, read_secret_file
from common.rankspec import RankSpec
from services.rank.disk_tier import DiskEntry, DiskTier, model_fingerprint, placement_name

log = logging.getLogger("lockstep.rank.disk_open")


def kvcache_root(home: str | Path) -> Path:
    return Path(home) / "kvcache"


def open_disk_tier(spec: RankSpec) -> tuple[DiskTier | None, dict[str, DiskEntry], bool]:
    """(tier or None, the entries it verified, whether the disk tier is wanted here):
    wanted but None means it could not open (this rank reports it off)."""
    s = spec.settings
    if s.prompt_cache_entries <= 0 or s.prompt_cache_disk_bytes <= 0:
        return None, {}, False
    try:
        key = read_secret_file(Path(spec.cache_key_path)) if spec.cache_key_path else b""
    except KeyFileError as exc:
        log.warning("disk prefix cache off on this rank: %s", exc)
        return None, {}, True
    if not key:
        log.warning("disk prefix cache off on this rank: no cache key in the launch")
        return None, {}, True
    t0 = time.monotonic()
    try:
        tier = DiskTier(kvcache_root(spec.home), model_fingerprint(Path(spec.model_path)),
                        placement_name(spec.replica, spec.tp, spec.pp, spec.rank),
                        spec.rank, key)
    except OSError as exc:
        log.warning("disk prefix cache off on this rank: %s", exc)
        return None, {}, True
    if not tier.enabled:
        return None, {}, True
    verified = tier.scan()
    st = tier.stats()
    log.info("disk prefix cache %s: %d entries verified (%d bytes), %d rejected, in %.2fs",
             tier.folder, len(verified), st.bytes, st.rejected, time.monotonic() - t0)
    return tier, verified, True
