"""A fake supervisor for reaper tests: a real launch manifest for itself, real ranks.

    python -m tests.fakes.fake_launcher --home DIR --deployment D --job J --ranks N \
        --ready-file FILE

It writes the launch secret and the manifest (its own pid and start time) before the
first rank starts, then starts N `tests.fakes.sleeper_rank` processes, each in a new
session, recording each one (pid, pgid, start time, command line) in the manifest as it
starts. Once every rank has written its marker it writes FILE (JSON: pid, ranks) and
waits. SIGKILL it to orphan the launch; SIGTERM makes it tear down like a real
supervisor (ladder, then manifest, secret and markers removed).

Rank behaviours pass through the environment (see sleeper_rank). `FakeSupervisor` is
the test-side handle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.atomic_json import write_json_atomic
from common.home import (
    Paths,
    marker_dir,
    marker_path,
    remove_manifest,
    retire_markers,
    write_manifest,
)
from common.keys import new_launch_secret
from common.procs import ProcessIdentity, identify, terminate_ladder
from common.records import LaunchManifest, RankRecord
from tests.support.polling import poll_for

ROOT = Path(__file__).resolve().parents[2]


def _settled_identity(pid: int, argv: list[str], timeout: float = 10.0) -> ProcessIdentity:
    """Popen returns before the kernel has set up the new argv (/proc shows it empty for
    a moment): record the identity only once it shows the real command line."""
    end = time.monotonic() + timeout
    while True:
        ident = identify(pid)
        if ident is not None and ident.cmdline == tuple(argv):
            return ident
        if time.monotonic() > end:
            raise TimeoutError(f"pid {pid} never showed its command line (now {ident})")
        time.sleep(0.002)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ready-file", type=Path, required=True)
    args = ap.parse_args(argv)
    paths = Paths(args.home).ensure()
    me = identify(os.getpid())
    assert me is not None
    secret = paths.secrets / f"{args.job}.key"
    new_launch_secret(secret)
    manifest = LaunchManifest(
        job_id=args.job, deployment_id=args.deployment, supervisor_pid=me.pid,
        supervisor_start_time=me.start_time, supervisor_boot_id="fake", created_at=time.time(),
        ranks=[], secret_path=str(secret))
    write_manifest(paths, manifest)
    log = open(paths.logs / f"{args.job}.ranks.log", "ab")
    for r in range(args.ranks):
        cmd = [sys.executable, "-m", "tests.fakes.sleeper_rank", "--home", str(paths.home),
               "--deployment", args.deployment, "--job", args.job, "--rank", str(r)]
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log)
        ident = _settled_identity(proc.pid, cmd)
        rec = RankRecord(rank=r, host="localhost", pid=proc.pid, pgid=os.getpgid(proc.pid),
                         start_time=ident.start_time, cmdline=list(ident.cmdline),
                         marker_dir=str(marker_dir(paths, args.deployment)), remote=False)
        manifest = dataclasses.replace(manifest, ranks=[*manifest.ranks, rec])
        write_manifest(paths, manifest)
    if os.environ.get("LOCKSTEP_FAKE_NO_MARKER") != "1":
        for r in range(args.ranks):
            p = marker_path(paths, args.deployment, r)
            poll_for(p.exists, 30.0, f"marker {p}", 0.02, error=TimeoutError)
    write_json_atomic(args.ready_file, {"schema_version": 1, "pid": me.pid,
                                        "start_time": me.start_time,
                                        "ranks": [rec.to_dict() for rec in manifest.ranks]})
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        signal.pause()
    ids = [ProcessIdentity(r.pid, r.start_time, r.cmdline) for r in manifest.ranks]
    out = terminate_ladder(ids, [r.pgid for r in manifest.ranks], term_timeout=5, kill_timeout=5)
    if out.survivors:
        return 1
    remove_manifest(paths, args.job)
    secret.unlink(missing_ok=True)
    retire_markers(paths, args.deployment)
    return 0


@dataclasses.dataclass
class FakeSupervisor:
    """Test-side handle on one fake launcher process."""

    proc: subprocess.Popen
    home: Path
    job_id: str
    deployment_id: str
    ranks: list[dict[str, Any]]
    start_time: float  # the launcher's own, as recorded in its manifest

    @classmethod
    def start(cls, home: Path, job_id: str, deployment_id: str, ranks: int = 2, *,
              env: dict[str, str] | None = None, timeout: float = 30.0) -> FakeSupervisor:
        ready = Path(home) / f"ready-{job_id}.json"
        cmd = [sys.executable, "-m", "tests.fakes.fake_launcher", "--home", str(home),
               "--deployment", deployment_id, "--job", job_id, "--ranks", str(ranks),
               "--ready-file", str(ready)]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL)
        try:
            poll_for(lambda: ready.exists() or proc.poll() is not None, timeout,
                     f"fake launcher {job_id} ready", 0.02, error=TimeoutError)
        except TimeoutError:
            proc.kill()
            raise
        if proc.poll() is not None:
            raise RuntimeError(f"fake launcher {job_id} exited with {proc.returncode}")
        info = json.loads(ready.read_text())
        ready.unlink()
        return cls(proc, Path(home), job_id, deployment_id, info["ranks"], info["start_time"])

    @property
    def rank_pids(self) -> list[int]:
        return [r["pid"] for r in self.ranks]

    def kill(self) -> None:
        """SIGKILL the fake supervisor and collect it (its ranks are orphaned)."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
