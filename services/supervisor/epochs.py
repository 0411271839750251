"""Cancel epochs: strictly increasing, persisted in runtime/state/cancel_epoch.json
before any broadcast carries them, so a restarted supervisor continues above the last.
An unreadable epoch file stops the supervisor (fail closed): guessing could reuse an
epoch that ranks would then ignore."""

from __future__ import annotations

import threading
from pathlib import Path

from common.atomic_json import SCHEMA_VERSION, StateFileError, read_json, write_json_atomic


class EpochStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.current = self._load()

    def _load(self) -> int:
        if not self.path.exists():
            return 0
        doc = read_json(self.path)
        epoch = doc.get("epoch")
        if type(epoch) is not int or epoch < 0:
            raise StateFileError(self.path, f"epoch must be an int >= 0, got {epoch!r}")
        return epoch

    def next(self) -> int:
        """Allocate the next epoch; it is on disk before this returns."""
        with self._lock:
            epoch = self.current + 1
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_json_atomic(self.path, {"schema_version": SCHEMA_VERSION, "epoch": epoch})
            self.current = epoch
            return epoch
