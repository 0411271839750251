"""The soak's faults (tests/faults/soak.py), one method `_f_<kind>` per kind in FAULTS,
drawn with WEIGHTS: a client disconnect, SIGKILL or SIGSTOP (short, or beyond the peer
grace) of a random rank, SIGKILL of the supervisor, and forged frames on every listening
ROUTER. A fault that takes the deployment down waits until the supervisor says so."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections import Counter

import httpx
import zmq

from common import messages as msgs
from common.envelope import Key, Signer
from common.rankspec import RankSpec

GRACE_S = 3.0  # LOCKSTEP_PEER_ABORT_GRACE
ADOPT_WINDOW_S = 30.0  # LOCKSTEP_ADOPT_WINDOW_S: `up`'s --adopt-window default
FAULTS = ("client_disconnect", "sigkill_rank", "sigstop_short", "sigstop_long",
          "kill_supervisor", "forge")
WEIGHTS = (3, 2, 2, 1, 1, 3)


class Faults:
    """Mixed into `Soak`: uses its rng, processes, deployment, admin client and polling."""

    def _ranks(self) -> list:
        if not self.dep:
            return []
        return self.jobs[self.dep["job_id"]].ranks

    def fault(self, kind: str) -> None:
        self.stats.faults[kind] += 1
        self.log.append(f"{time.monotonic():.1f} {kind} on {self.dep and self.dep['deployment_id']}")
        getattr(self, f"_f_{kind}")()

    def _f_client_disconnect(self) -> None:
        with httpx.Client(timeout=30) as http:
            self.clients.record(self.clients.stream_once(http, 200, disconnect=True))

    def _f_sigkill_rank(self) -> None:
        r = self.rng.choice(self._ranks())
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGKILL)
        self._expect_down()

    def _stop_for(self, seconds: float) -> None:
        r = self.rng.choice(self._ranks())
        os.kill(r.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault's duration, not synchronisation
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.pid, signal.SIGCONT)

    def _f_sigstop_short(self) -> None:
        self._stop_for(self.rng.uniform(0.3, 1.2))

    def _f_sigstop_long(self) -> None:
        r = self.rng.choice(self._ranks())
        os.kill(r.pid, signal.SIGSTOP)  # left stopped: the teardown must SIGKILL it
        self._expect_down()

    def _f_kill_supervisor(self) -> None:
        """SIGKILL of the supervisor, restarted as `lockstep up` restarts it: the adoption
        record says so (the reaper waits), and the new supervisor adopts the running
        deployment — its streams go on; a launch it did not adopt is stopped and redeployed
        by `restore`. Without adoption (`adopts` False) the deployment counts as dead."""
        p = self.procs["supervisor"]
        if self.adopts:
            self.write_adoption_record(restarting_until=time.time() + ADOPT_WINDOW_S)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        self.stats.supervisor_restarts += 1
        self.start_supervisor()  # its admin socket answers once its adoption pass is over
        if self.adopts:
            self.write_adoption_record(restarting_until=None)
        dep_id = self.dep and self.dep["deployment_id"]
        info = self._dep_info(dep_id) if dep_id and self.adopts else None
        if info is not None and info["state"] == "serving":
            self.stats.adopted += 1
            self.log.append(f"  {dep_id} adopted")
            return
        if self.dep:
            self.log.append(f"  {dep_id} not adopted: {info and info['state']}")
            self.dead_jobs.add(self.dep["job_id"])
        self.dep = None

    def _rejected(self) -> dict[str, int]:
        """Rejected bus frames by service ("supervisor", "rank"), from admin status."""
        reply = self.admin("status", 20)
        out: Counter = Counter()
        for row in reply.data.get("rejections") or [] if reply.ok else []:
            out[row["service"]] += row["count"]
        return out

    def _f_forge(self) -> None:
        before = self._rejected()
        targets = {"admin": self.admin_ep, "report": f"tcp://127.0.0.1:{self.ports['report']}"}
        if self.dep:
            targets["requests"] = self.dep["requests_endpoint"]
            spec = RankSpec.load(self.rank0_spec(self.dep["job_id"]))
            targets["plan"] = spec.plan_endpoint
        wrong = Signer(Key.from_secret(secrets.token_bytes(32)), "mallory")
        dep_id = (self.dep or {}).get("deployment_id", "x")
        job = (self.dep or {}).get("job_id", "x")
        bodies = [msgs.AdminRequest("rogue", "status", {}),
                  msgs.Generate("rogue-" + secrets.token_hex(4), [1, 2, 3], 4),
                  msgs.AuthHello(dep_id, job, 1, secrets.token_bytes(16))]
        socks = []
        for name, ep in targets.items():
            s = self.zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.connect(ep)
            socks.append(s)
            for _ in range(self.rng.randint(10, 40)):
                roll = self.rng.random()
                if roll < 0.4:
                    frames = [self.rng.randbytes(self.rng.randint(1, 400))]
                elif roll < 0.55:
                    frames = [self.rng.randbytes(20) for _ in range(self.rng.randint(2, 5))]
                else:
                    frames = [wrong.encode(self.rng.choice(bodies))]
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(frames, zmq.NOBLOCK)
            self.log.append(f"  forged to {name} {ep}")
        # Evidence they were read and refused (counted), not silently lost: the
        # supervisor's own sockets, and the ranks' (telemetry) when a deployment runs.
        services = ["supervisor", "rank"] if self.dep else ["supervisor"]
        self._poll("the forged frames to be counted as rejected",
                   lambda: (now := self._rejected())
                   and all(now[sv] > before[sv] for sv in services), 15, interval=0.3)
        for s in socks:
            s.close(0)

    def _expect_down(self) -> None:
        """The fault kills the deployment: wait until the supervisor says so."""
        dep_id = self.dep["deployment_id"]
        state = self._poll(f"{dep_id} to be reported down",
                           lambda: (d := self._dep_info(dep_id)) is not None
                           and d["state"] in ("failed", "teardown_failed") and d["state"],
                           GRACE_S + 30, interval=0.2)
        self.log.append(f"  {dep_id} -> {state}")
