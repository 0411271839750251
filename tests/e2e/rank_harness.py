"""A real driver for rank processes: it plays the supervisor (and the gateway) for tests
and benchmarks. Nothing here is mocked: ranks are `python -m services.rank` subprocesses
on the real MLX ring backend over loopback, talking signed ZeroMQ.

    with Deployment(tmp_path, mode="tp") as d:      # mode: single | tp | pp
        r = d.generate([1, 2, 3], max_tokens=8)     # Result(tokens, finish_reason, ...)

The stub thread (tests/e2e/rank_harness_stub.py) owns every harness socket: leases,
the report handshake, cancels re-sent until acked, TOKENS routed into per-request
streams. Starting, signalling and proving the rank processes gone is in
tests/e2e/rank_harness_process.py.

Watchdog tests: `pause_leases()` stops the LEASE renewals; `Deployment(..., launcher=True)`
starts the ranks through a stand-in launcher process (tests/e2e/rank_launcher.py) instead
of as children of the test (SIGKILL `d.launcher_proc` to orphan them); `rank_env={r:
{...}}` adds environment to one rank only.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import messages as m
from common.atomic_json import read_json
from common.home import Paths, marker_path
from common.keys import LaunchKeys, new_launch_secret
from common.rank_env import rank_environment
from common.rankspec import SCHEMA_VERSION, RankSettings, RankSpec
from services.rank.removals import read_removals, removals_path, token_digest
from tests.e2e.rank_harness_process import (
    REPO,
    Orphanable,
    assert_groups_gone,
    poll_until,
    signal_groups,
    spawn_rank,
    start_launcher,
)
from tests.e2e.rank_harness_stub import Stub
from tests.support.ports import free_ports

MODEL_CACHE = Path(os.environ.get("LOCKSTEP_TEST_MODEL_CACHE",
                                  Path(tempfile.gettempdir()) / "lockstep-models"))
__all__ = ["REPO", "Deployment", "Result", "model_dir", "poll_until", "token_digest", "words"]


def words(seed: int, n: int, vocab: int = 900) -> list[int]:
    """`n` token ids in [5, 5 + vocab), a fixed function of `seed` (distinct seeds share no
    prefix): prompts for real ranks, within both presets' vocabularies."""
    x, out = seed * 7919 + 17, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(5 + x % vocab)
    return out


def model_dir(preset: str = "tiny") -> Path:
    """The embedded model, built once per machine (build_model is idempotent)."""
    from models.tinymodel import build_model

    return build_model(MODEL_CACHE / f"{preset}-0", preset=preset, seed=0)


@dataclass
class Result:
    request_id: str
    tokens: list[int]
    finish_reason: str | None
    error: str | None = None
    model_ttft_ms: float | None = None
    token_times: list[float] = field(default_factory=list)
    chunks: list[m.Tokens] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return token_digest(self.tokens)


class Deployment:
    def __init__(self, root: Path, *, mode: str = "single", preset: str = "tiny",
                 settings: dict | None = None, env: dict | None = None,
                 cancel_epoch_floor: int = 0, lease_epoch: int | None = None,
                 backend: str = "ring", rank_env: dict[int, dict] | None = None,
                 launcher: bool = False, home: Path | None = None,
                 cache_key: bytes | None = None, model: Path | None = None) -> None:
        """`home`: $LOCKSTEP_HOME (default: under `root`), shared by deployments that
        share a disk prefix cache; `cache_key`: that cache's key (None: no disk tier);
        `model`: a model directory instead of the preset's."""
        self.root = Path(root)
        self.mode = mode
        self.world = 1 if mode == "single" else 2
        self.model = Path(model) if model is not None else model_dir(preset)
        self.settings = RankSettings(**{"rank_test_seams": True, **(settings or {})})
        self.extra_env = dict(env or {})
        self.per_rank_env = {r: dict(e) for r, e in (rank_env or {}).items()}
        self.use_launcher = launcher
        self.launcher_proc: subprocess.Popen | None = None
        self.deployment_id = "d-" + secrets.token_hex(4)
        self.job_id = "j-" + secrets.token_hex(4)
        self.topic = b"ctl:" + self.deployment_id.encode()
        self.paths = Paths(Path(home) if home else self.root / "home").ensure()
        self.cache_key_path = ""
        if cache_key is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            key_file = self.root / "kvcache.key"
            key_file.write_text(cache_key.hex() + "\n")
            key_file.chmod(0o600)
            self.cache_key_path = str(key_file)
        self.secret_path = self.paths.secrets / f"{self.job_id}.key"
        self.keys = LaunchKeys(new_launch_secret(self.secret_path), self.deployment_id,
                               self.job_id)
        ports = free_ports(4 + self.world)
        ep = [f"tcp://127.0.0.1:{p}" for p in ports[:4]]
        self.control_endpoint, self.report_endpoint, self.plan_endpoint, \
            self.requests_endpoint = ep
        self.hostfile = self.root / "hosts.json"
        self.hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[4:]]))
        self.cancel_epoch_floor = cancel_epoch_floor
        self.lease_epoch = cancel_epoch_floor if lease_epoch is None else lease_epoch
        self.epoch = self.lease_epoch
        self.backend = backend if self.world > 1 else "none"
        self.procs: dict[int, subprocess.Popen | Orphanable] = {}
        self.stub: Stub | None = None
        self.teardown_path: str | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def spec(self, rank: int) -> RankSpec:
        return RankSpec(
            schema_version=SCHEMA_VERSION, deployment_id=self.deployment_id,
            job_id=self.job_id, rank=rank, world_size=self.world,
            tp=2 if self.mode == "tp" else 1, pp=2 if self.mode == "pp" else 1,
            host="127.0.0.1", model_path=str(self.model), backend=self.backend,
            home=str(self.paths.home), secret_path=str(self.secret_path),
            control_endpoint=self.control_endpoint, report_endpoint=self.report_endpoint,
            plan_endpoint=self.plan_endpoint, requests_endpoint=self.requests_endpoint,
            supervisor_pid=os.getpid(), cancel_epoch_floor=self.cancel_epoch_floor,
            hostfile=str(self.hostfile) if self.world > 1 else "", settings=self.settings,
            cache_key_path=self.cache_key_path)

    def rank_env(self, rank: int) -> dict[str, str]:
        env = rank_environment(self.settings, os.environ)
        env.update(self.extra_env)
        env.update(self.per_rank_env.get(rank, {}))
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        if self.world > 1:
            env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(self.hostfile))
        return env

    def start(self, timeout: float = 120.0) -> Deployment:
        self.stub = Stub(self)
        self.stub.start()
        (self.root / "logs").mkdir(exist_ok=True)
        plan = []
        for r in range(self.world):
            spec_file = self.root / f"rank-{r}.spec.json"
            self.spec(r).save(spec_file)
            argv = [sys.executable, "-m", "services.rank", "--spec", str(spec_file)]
            if self.use_launcher:
                plan.append({"argv": argv, "env": self.rank_env(r), "cwd": str(REPO),
                             "log": str(self.log_path(r))})
                continue
            self.procs[r] = spawn_rank(argv, self.rank_env(r), self.log_path(r))
        if plan:
            self._start_launcher(plan)
        try:
            self.wait(lambda: len(self.stub.ready) == self.world, timeout, "RANK_READY")
            self.stub.post(("pub", m.Serve(self.deployment_id, self.job_id)))
            self.wait(lambda: all(self.marker(r).get("phase") == "serving"
                                  for r in range(self.world)), 30, "phase serving")
        except BaseException:
            self.teardown()
            raise
        return self

    def _start_launcher(self, plan: list[dict]) -> None:
        self.launcher_proc = start_launcher(self.root / "launch-plan.json", plan)
        pids = json.loads(self.launcher_proc.stdout.readline() or "[]")
        if len(pids) != self.world:
            raise RuntimeError(f"the stand-in launcher started {pids}, not {self.world} ranks")
        self.procs = {r: Orphanable(pid) for r, pid in enumerate(pids)}

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def live_ranks(self) -> set[int]:
        return {r for r, p in self.procs.items() if p.poll() is None}

    def shutdown(self, timeout: float = 20.0) -> dict[int, int]:
        self.stub.post(("pub", m.Shutdown(self.deployment_id, self.job_id, "test")))
        return self.wait_exit(timeout=timeout)

    def wait_exit(self, ranks=None, timeout: float = 20.0) -> dict[int, int]:
        ranks = list(self.procs) if ranks is None else list(ranks)
        poll_until(lambda: all(self.procs[r].poll() is not None for r in ranks), timeout,
                   f"ranks {ranks} to exit")
        return {r: self.procs[r].returncode for r in ranks}

    def teardown(self) -> None:
        """SHUTDOWN → SIGTERM → SIGKILL, each to every rank's process group; then prove
        every rank is gone. `teardown_path` records the step that ended it."""
        try:
            if self.stub is not None and self.live_ranks():
                self.stub.post(("pub", m.Shutdown(self.deployment_id, self.job_id, "teardown")))
                self.teardown_path = "shutdown"
            for sig, wait in ((None, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if sig is not None and self.live_ranks():
                    self.teardown_path = sig.name
                    signal_groups(self.procs.values(), sig)
                deadline = time.monotonic() + wait
                while self.live_ranks() and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert_groups_gone(self.procs.values())
        finally:
            if self.launcher_proc is not None:
                if self.launcher_proc.poll() is None:
                    self.launcher_proc.kill()
                self.launcher_proc.wait(5)
                self.launcher_proc.stdout.close()
            if self.stub is not None:
                self.stub.stopped = True
                self.stub.join(5)

    # -- observation --------------------------------------------------------------------

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self.stub.cv:
            while True:
                v = pred()
                if v:
                    return v
                dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
                left = deadline - time.monotonic()
                if left <= 0 or (dead and what in ("RANK_READY", "phase serving")):
                    raise self._timeout(what, timeout)
                self.stub.cv.wait(min(left, 0.1))

    def _timeout(self, what: str, timeout: float) -> TimeoutError:
        dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
        tails = {r: self.log(r)[-3000:] for r in self.procs}
        return TimeoutError(f"{what}: not reached in {timeout:.0f}s; exited {dead}; logs {tails}")

    def log_path(self, rank: int) -> Path:
        return self.root / "logs" / f"rank-{rank}.log"

    def log(self, rank: int) -> str:
        try:
            return self.log_path(rank).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def marker(self, rank: int) -> dict:
        try:
            return read_json(marker_path(self.paths, self.deployment_id, rank))
        except Exception:  # noqa: BLE001 - not written yet
            return {}

    def removals(self, rank: int) -> list[dict]:
        return read_removals(removals_path(self.paths, self.deployment_id, rank))

    def telemetry(self, rank: int) -> m.Telemetry | None:
        with self.stub.cv:
            return self.stub.telemetry.get(rank)

    def fresh_telemetry(self, rank: int, timeout: float = 5.0) -> m.Telemetry:
        t0 = time.time()
        return self.wait(lambda: (t := self.stub.telemetry.get(rank)) and t.at > t0 and t,
                         timeout, f"telemetry from rank {rank}")

    # -- requests -------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int = 16, *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_token_ids=(),
               request_id: str | None = None, speculative: bool = True) -> str:
        rid = request_id or "r-" + secrets.token_hex(6)
        sampling = m.Sampling(temperature=temperature, top_p=top_p, seed=seed,
                              speculative=speculative)
        self.stub.post(("req", m.Generate(rid, list(prompt), max_tokens, sampling,
                                          list(stop_token_ids), "harness")))
        return rid

    def chunks(self, rid: str) -> list[m.Tokens]:
        with self.stub.cv:
            return list(self.stub.streams.get(rid, ()))

    def wait_tokens(self, rid: str, n: int, timeout: float = 60.0) -> int:
        return self.wait(lambda: sum(len(c.tokens) for c in self.stub.streams.get(rid, ())) >= n
                         and n, timeout, f"{n} tokens of {rid}")

    def result(self, rid: str, timeout: float = 60.0) -> Result:
        with self.stub.cv:
            ended = self.stub.ended[rid]
        if not ended.wait(timeout):  # an Event: no wake-up per token (benchmarks)
            raise self._timeout(f"the end of {rid}", timeout)
        chunks = self.chunks(rid)
        tokens: list[int] = []
        for c in chunks:
            assert c.index == len(tokens), f"{rid}: chunk index {c.index} after {len(tokens)}"
            tokens.extend(c.tokens)
        last = chunks[-1]
        assert last.finish_reason and all(c.finish_reason is None for c in chunks[:-1])
        return Result(rid, tokens, last.finish_reason, last.error,
                      next((c.model_ttft_ms for c in chunks if c.model_ttft_ms is not None), None),
                      [t for c in chunks for t in c.token_times], chunks)

    def generate(self, prompt: list[int], max_tokens: int = 16, timeout: float = 60.0,
                 **kw) -> Result:
        return self.result(self.submit(prompt, max_tokens, **kw), timeout)

    def abort(self, rid: str, reason: str = "client") -> None:
        self.stub.post(("req", m.Abort(rid, reason)))

    def stats(self, timeout: float = 10.0) -> m.Stats:
        rid = "s-" + secrets.token_hex(6)
        self.stub.post(("req", m.StatsRequest(rid)))
        return self.wait(lambda: self.stub.stats.get(rid), timeout, "STATS")

    # -- control ------------------------------------------------------------------------

    def cancel(self, scope: str = "all", request_ids=(), *, epoch: int | None = None,
               resend_s: float = 15.0) -> int:
        """Publish a cancel and re-send it until every live rank acked (or resend_s)."""
        if epoch is None:
            self.epoch += 1
            epoch = self.epoch
        c = m.Cancel(self.deployment_id, epoch, scope, list(request_ids), "test")
        self.stub.post(("cancel", c, resend_s))
        return epoch

    def pause_leases(self) -> None:
        """The supervisor stops renewing its lease (as if it hung)."""
        self.stub.leases_paused = True

    def publish_once(self, body) -> None:
        self.stub.post(("pub", body))

    def acks(self, epoch: int) -> dict[int, m.CancelAck]:
        with self.stub.cv:
            return dict(self.stub.acks.get(epoch, {}))

    def wait_acks(self, epoch: int, timeout: float = 20.0) -> dict[int, m.CancelAck]:
        self.wait(lambda: len(self.stub.acks.get(epoch, {})) == self.world, timeout,
                  f"acks for epoch {epoch}")
        return self.acks(epoch)
