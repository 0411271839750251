"""The stale-marker sweep: retire `runtime/markers/<deployment>/` directories whose
every owner is dead and that no launch manifest names.

A marker owner is alive when its pid runs (not a zombie) with the recorded start time;
markers carry no command line, so a reused pid with another start time is a dead owner.
What is not proven stale stays: a directory holding a marker that cannot be read, an
empty directory younger than `EMPTY_MARKER_DIR_GRACE_S` (a launch may be creating it),
and anything not named like a deployment id.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from common.home import Paths, read_manifests, read_markers, retire_markers
from common.procs import START_TIME_TOLERANCE, identify

EMPTY_MARKER_DIR_GRACE_S = 60.0


def owner_alive(pid: int, start_time: float) -> bool:
    current = identify(pid)
    return current is not None and abs(current.start_time - start_time) <= START_TIME_TOLERANCE


def protected_deployments(paths: Paths) -> set[str] | None:
    """Deployments of every manifest on disk now (re-read: a supervisor may have
    launched since the pass began). None if a manifest cannot be read: it may name any
    deployment, so nothing may be retired."""
    scan = read_manifests(paths)
    if scan.unreadable:
        return None
    return {m.deployment_id for _, m in scan.manifests}


def sweep_markers(paths: Paths, protected: set[str], report: Any) -> None:
    """Retire stale marker directories; appends to `report.retired_markers` and
    `report.unreadable_markers` (a ReapReport)."""
    scan = read_markers(paths)
    report.unreadable_markers += [{"path": str(p), "error": e} for p, e in scan.unreadable]
    unsure = {p.parent.name for p, _ in scan.unreadable}
    live = {m.deployment_id for _, m in scan.markers if owner_alive(m.pid, m.start_time)}
    has_markers = {m.deployment_id for _, m in scan.markers}
    try:
        entries = sorted(os.scandir(paths.markers), key=lambda e: e.name)
    except FileNotFoundError:
        return
    now = time.time()
    for entry in entries:
        dep = entry.name
        if (dep.startswith(".") or not entry.is_dir(follow_symlinks=False)
                or dep in protected or dep in live or dep in unsure):
            continue
        if dep not in has_markers:
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime < EMPTY_MARKER_DIR_GRACE_S:
                    continue
        try:
            if retire_markers(paths, dep):
                report.retired_markers.append(dep)
        except (ValueError, OSError) as exc:  # a name that is no deployment id: leave it
            report.unreadable_markers.append({"path": entry.path, "error": str(exc)})
