"""What each host-agent command answers, typed: the agent writes these (`to_wire`), the
caller's side (client.py `RemoteHost.ask`) decodes each answer once, strictly
(common/schema.py), and every reader keeps the object. A probe's markers are read into
RankMarker records here, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.atomic_json import StateFileError
from common.messages.vocab import ProcState
from common.procs import ProcessIdentity
from common.records import RankMarker

_LONG = {"max_len": 65536}


@dataclass(frozen=True)
class Identity:
    """A process as `identify` reads it (pid + start time + command line)."""

    pid: int
    start_time: float
    cmdline: list[str]

    def ident(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_time, tuple(self.cmdline))


@dataclass(frozen=True)
class Sent:
    """signal, signal-group: sent only if the identity still held."""

    sent: bool


@dataclass(frozen=True)
class Survivors:
    """wait-exit: what was still alive at the deadline."""

    survivors: list[Identity]


@dataclass(frozen=True)
class ProcessState:
    pid: int
    state: ProcState
    current: Identity | None  # what holds the pid now (None: nothing)


@dataclass(frozen=True)
class MarkerFile:
    path: str
    marker: dict[str, object]  # a RankMarker record (common/records.py)


@dataclass(frozen=True)
class UnreadableFile:
    path: str
    reason: str = field(metadata=_LONG)


@dataclass(frozen=True)
class Markers:
    """read-markers: the markers under a home (one deployment's, or all)."""

    markers: list[MarkerFile] = field(default_factory=list)
    unreadable: list[UnreadableFile] = field(default_factory=list)

    def rank_markers(self, where: str = "") -> list[RankMarker]:
        """Each marker as a RankMarker; one that is not a marker record is skipped."""
        out = []
        for m in self.markers:
            try:
                out.append(RankMarker.from_dict(m.marker, path=f"{where}:{m.path}"
                                                if where else m.path))
            except StateFileError:
                continue
        return out


@dataclass(frozen=True)
class Probe(Markers):
    """probe: each recorded process's state there (and, with --home, the markers)."""

    processes: list[ProcessState] = field(default_factory=list)

    def states(self) -> dict[int, ProcState]:
        return {p.pid: p.state for p in self.processes}


@dataclass(frozen=True)
class Spawned(Identity):
    """spawn: the started process and its group (`exited` 0: it already finished)."""

    pgid: int = 0
    exited: int | None = None


@dataclass(frozen=True)
class Written:
    path: str
    bytes: int
    mode: str


@dataclass(frozen=True)
class Removed:
    removed: list[str]
    missing: list[str]


@dataclass(frozen=True)
class FreePorts:
    host: str
    ports: list[int]
