"""The rank's report session (services/rank/auth.py ReportSession) on real ZeroMQ sockets
against a supervisor's Gate: the start-up handshake, then a supervisor killed and
restarted on the same endpoint (a new process: new sender and boot, no session for the
rank). The rank handshakes again on the same DEALER, and what it reports afterwards is
let through by the new supervisor; a re-handshake with nobody there never fails the rank."""

from __future__ import annotations

import collections
import secrets
import time

import pytest
import zmq

from common import messages as m
from common.bus import Channel, configure, configure_listener
from common.handshake import Gate, Responder, session_keys
from common.keys import LaunchKeys
from common.rankspec import SCHEMA_VERSION, RankSettings, RankSpec
from services.rank.auth import Origin, ReportSession
from services.rank.plan_channel import Wire
from tests.support.ports import free_ports

DEP, JOB = "dep", "job"
KEYS = LaunchKeys(secrets.token_bytes(32), DEP, JOB)
DEADLINE_S = 1.5


class Supervisor:
    """A supervisor process's report ROUTER: the Gate, and what it let through."""

    def __init__(self, ctx: zmq.Context, endpoint: str, pid: int) -> None:
        self.chan = Channel("supervisor", "report", sender=f"supervisor:host:{pid}",
                            send_key=KEYS.report, accept=m.REPORT)
        self.chan.signer.boot = f"{secrets.token_hex(8)}.{secrets.token_hex(3)}"  # a process
        self.sock = configure_listener(ctx.socket(zmq.ROUTER), max_size=256 * 1024)
        bind_again(self.sock, endpoint)
        self.gate = Gate(self.chan, Responder("report", DEP, JOB, range(1),
                                              lambda r: session_keys(KEYS, r)),
                         lambda ident, body: self.sock.send_multipart(
                             [ident, self.chan.pack(body)], zmq.NOBLOCK))
        self.got: list[object] = []

    @property
    def origin(self) -> Origin:
        return Origin(self.chan.signer.sender, self.chan.signer.boot.partition(".")[0])

    def read(self) -> None:
        while self.sock.poll(0):
            got = self.gate.admit(self.sock.recv_multipart())
            if got is not None:
                self.got.append(got[1].body)

    def close(self) -> None:
        self.sock.close(linger=0)


class Rank:
    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        spec = RankSpec(schema_version=SCHEMA_VERSION, deployment_id=DEP, job_id=JOB, rank=0,
                        world_size=1, tp=1, pp=1, host="h", model_path="/m", backend="none",
                        home="/tmp", secret_path="/s", control_endpoint="tcp://127.0.0.1:1",
                        report_endpoint=endpoint, plan_endpoint="tcp://127.0.0.1:3",
                        requests_endpoint="tcp://127.0.0.1:4", supervisor_pid=1,
                        settings=RankSettings(auth_timeout_s=DEADLINE_S))
        self.chan = Channel("rank", "report", sender=f"{DEP}/rank-0", send_key=KEYS.report,
                            accept=m.REPORT_TO_RANK)
        self.sock = configure(ctx.socket(zmq.DEALER))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 20)
        self.failed: list[str] = []
        self.session = ReportSession(spec, KEYS, self.chan, self.sock,
                                     Wire(collections.Counter()), on_fail=self.failed.append)

    def pump(self) -> bool:
        """One pass of the I/O thread's part; True when the supervisor just accepted us."""
        self.session.timers(time.monotonic(), dict)
        while self.sock.poll(0):
            self.session.on_frames(self.sock.recv_multipart())
        return self.session.accepted_now()


def until_accepted(rank: Rank, sup: Supervisor) -> float:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if rank.pump():
            return time.monotonic()
        sup.read()
        zmq.select([rank.sock, sup.sock], [], [], 0.01)
    raise AssertionError(f"not accepted within {DEADLINE_S}s; rejects: "
                         f"{sup.chan.rejects.snapshot()} / {rank.chan.rejects.snapshot()}")


def until_got(rank: Rank, sup: Supervisor, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and len(sup.got) < n:
        rank.pump()
        sup.read()
        zmq.select([rank.sock, sup.sock], [], [], 0.01)
    assert len(sup.got) >= n, sup.chan.rejects.snapshot()


def ack(epoch: int) -> m.CancelAck:
    return m.CancelAck(deployment_id=DEP, epoch=epoch, rank=0, step_applied=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_the_rank_re_authenticates_with_a_restarted_supervisor(ctx):
    [endpoint] = free_endpoints(1)  # both supervisors bind it in turn
    first = Supervisor(ctx, endpoint, pid=1)
    rank = Rank(ctx, endpoint)
    until_accepted(rank, first)
    s = rank.session
    assert s.peer == first.origin and s.proofs == 1 and s.reauths == 0
    s.send(ack(1))
    until_got(rank, first, 1)
    assert first.got == [ack(1)]

    first.close()  # SIGKILL: the same endpoint is bound again by a new process
    s.reauthenticate()  # (the control intake asks, on the new process's first lease)
    s.reauthenticate()  # one handshake at a time: a second ask changes nothing
    link = s.link
    s.send(ack(2))  # not accepted yet: reports wait (the new ROUTER would refuse them)
    link.started_at -= 1000.0  # as if nobody had answered for long past auth_timeout_s
    assert rank.pump() is False
    assert rank.failed == []  # a re-handshake never fails the rank: the lease decides
    assert s.link is link and s.peer == first.origin  # still the old one, until a proof

    second = Supervisor(ctx, endpoint, pid=2)
    until_accepted(rank, second)
    assert s.peer == second.origin and s.proofs == 2 and s.reauths == 1
    assert second.chan.rejects.snapshot().get("unauthenticated", 0) == 0
    s.send(ack(3))
    until_got(rank, second, 1)
    assert second.got == [ack(3)]  # let through: the new supervisor knows this rank now
    assert rank.failed == [] and rank.chan.rejects.snapshot() == {}
    second.close()


# -- the whole I/O thread (services/rank/io.py) against two supervisor processes ---------


class SupervisorProcess(Supervisor):
    """Report ROUTER and control PUB of one supervisor process (one boot id for both)."""

    def __init__(self, ctx: zmq.Context, report: str, control: str, pid: int) -> None:
        super().__init__(ctx, report, pid)
        self.ctl = Channel("supervisor", "control", sender=self.chan.signer.sender,
                           send_key=KEYS.control)
        self.ctl.signer.boot = self.chan.signer.boot.partition(".")[0] + ".ctl"
        self.pub = configure(ctx.socket(zmq.PUB))
        bind_again(self.pub, control)

    def publish(self, body, chan: Channel | None = None) -> None:
        self.pub.send_multipart([b"ctl:" + DEP.encode(), (chan or self.ctl).pack(body)])

    def readies(self) -> int:
        return sum(isinstance(b, m.RankReady) for b in self.got)

    def close(self) -> None:
        super().close()
        self.pub.close(linger=0)


def bind_again(sock: zmq.Socket, endpoint: str) -> None:
    """Bind `endpoint`, which the killed "process" (a socket of this one, closed: libzmq
    releases the port on its I/O thread, a moment later) held: a real restart binds once
    the dead process's port is free."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def free_endpoints(n: int) -> list[str]:
    """Ports from below the ephemeral range (common/ports.py): one bound to port 0 and
    closed could be taken by any outgoing connection before RankIO binds it (seen in CI:
    "Address already in use")."""
    return [f"tcp://127.0.0.1:{p}" for p in free_ports(n)]


def lease(seq: int) -> m.Lease:
    return m.Lease(deployment_id=DEP, job_id=JOB, lease_seq=seq, ttl_s=10.0, cancel_epoch=0)


def test_the_io_thread_is_adopted_by_a_restarted_supervisor(ctx, tmp_path):
    from services.rank import events as ev
    from services.rank import outbox as out
    from services.rank.io import RankIO
    from services.rank.runtime import RankRuntime

    report, control, plan, requests = free_endpoints(4)
    spec = RankSpec(schema_version=SCHEMA_VERSION, deployment_id=DEP, job_id=JOB, rank=0,
                    world_size=1, tp=1, pp=1, host="h", model_path="/m", backend="none",
                    home=str(tmp_path), secret_path="/s", control_endpoint=control,
                    report_endpoint=report, plan_endpoint=plan,
                    requests_endpoint=requests, supervisor_pid=1,
                    watch_parent=False, settings=RankSettings(auth_timeout_s=DEADLINE_S,
                                                              rank_telemetry_interval_s=0.05))
    rt = RankRuntime(spec)
    io = RankIO(spec, KEYS, rt)
    rt.attach_io(io)
    events: list[object] = []
    seq = iter(range(1, 10**6))

    def until(sup: SupervisorProcess, done, what: str, publish=()) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            for send in publish:  # re-sent until answered, as the supervisor does
                send()
            sup.read()
            while not io.inbox.empty():
                events.append(io.inbox.get_nowait())
            if done():
                return
            sup.sock.poll(10)
        raise AssertionError(f"{what}: not within {DEADLINE_S}s; {io.reject_counts()}; "
                             f"events {[type(e).__name__ for e in events]}; "
                             f"supervisor got {[type(b).__name__ for b in sup.got]}")

    serve = m.Serve(deployment_id=DEP, job_id=JOB)
    first = SupervisorProcess(ctx, report, control, pid=1)
    io.start()
    try:
        io.post(out.AnnounceReady(m.RankReady(deployment_id=DEP, job_id=JOB, rank=0, host="h",
                                              pid=7, start_time=1.0, boot_id="b")))
        until(first, lambda: first.readies() >= 1, "RANK_READY",
              publish=(lambda: first.publish(lease(next(seq))),))
        until(first, lambda: any(isinstance(e, ev.ServeEv) for e in events), "SERVE",
              publish=(lambda: first.publish(serve),))  # as the supervisor: after READY
        io.post(out.Served())
        old_ctl = first.ctl
        first.close()  # killed; a new process binds the same endpoints
        deadline = time.monotonic() + DEADLINE_S
        while not io.reporting.muted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert io.reporting.muted, "the dropped report connection was not seen"
        time.sleep(0.3)  # six telemetry intervals with nobody there: held, not queued

        second = SupervisorProcess(ctx, report, control, pid=2)
        got_at = len(second.got)
        until(second, lambda: second.readies() >= 1
              and any(isinstance(b, m.Telemetry) for b in second.got[got_at:]),
              "RANK_READY and telemetry to the restarted supervisor",
              publish=(lambda: second.publish(lease(next(seq))),))
        assert io.reporting.reauths == 1 and io.reporting.peer == second.origin
        # nothing queued for the dead process reached the new one (it would refuse it)
        assert second.chan.rejects.snapshot() == {}, second.chan.rejects.snapshot()
        served = sum(isinstance(e, ev.ServeEv) for e in events)
        until(second, lambda: sum(isinstance(e, ev.ServeEv) for e in events) > served,
              "the restarted supervisor's SERVE", publish=(lambda: second.publish(serve),))
        # The old process's control, still in flight: dropped and counted, never acted on.
        shutdown = m.Shutdown(deployment_id=DEP, job_id=JOB)
        until(second, lambda: io.drops["control.old_supervisor"] >= 1, "old control counted",
              publish=(lambda: second.publish(shutdown, old_ctl),))
    finally:
        io.stop()
    assert not any(isinstance(e, ev.ShutdownEv) for e in events)
