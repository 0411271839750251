"""A loading rank's progress for telemetry: bytes this process has read since loading
began, of the total size of its model's *.safetensors (LoadProgress).

Read from /proc/self/io `rchar` (bytes the process read through read(2), served from the
page cache or not), sampled by the I/O thread at each telemetry: the last sample before
the phase is `loading` is the baseline, so the imports before are not counted. It counts
every read the load makes (the tokenizer's files too), so it is capped at the total; where
/proc is absent (macOS) there is no progress (None). Only the I/O thread calls `sample`.
"""

from __future__ import annotations

from pathlib import Path

from common.messages import LoadProgress, Phase

PROC_IO = Path("/proc/self/io")


def read_chars(path: Path = PROC_IO) -> int | None:
    """`rchar` of /proc/<pid>/io, or None if it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            key, _, val = line.partition(":")
            if key == "rchar":
                return int(val)
    except (OSError, ValueError):
        return None
    return None


def weights_size(model_path: str) -> int:
    try:
        return sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors"))
    except OSError:
        return 0


class LoadMeter:
    def __init__(self, read=read_chars) -> None:
        self.read = read
        self.baseline: int | None = None
        self.total: int | None = None

    def sample(self, phase: Phase, model_path: str) -> LoadProgress | None:
        now = self.read()
        if phase != Phase.LOADING:
            if self.total is None:  # not loaded yet: the baseline moves with the reads
                self.baseline = now
            return None
        if self.total is None:
            self.total = weights_size(model_path)
        if now is None or not self.total:
            return None
        done = max(0, now - (self.baseline if self.baseline is not None else now))
        return LoadProgress(read_bytes=min(done, self.total), total_bytes=self.total)


_METER = LoadMeter()


def sample(phase: Phase, model_path: str) -> LoadProgress | None:
    """The process's meter (one rank per process)."""
    return _METER.sample(phase, model_path)
