"""The rank's control intake (services/rank/control_intake.py), fed real signed frames:
an authentic control message that arrives before the supervisor's proof is held (not
counted) and delivered after it; anything forged, tampered, replayed, mis-framed or for
another deployment is counted exactly as before, proof or no proof. A restarted
supervisor (another process, the same launch key) is held until it proved itself, asks
for a re-authentication, and then replaces the old one, whose control is counted."""

from __future__ import annotations

import collections
import secrets

import pytest

from common import messages as m
from common.bus import Channel
from common.envelope import Key
from services.rank.auth import Origin
from services.rank.control_intake import ControlIntake

DEP, JOB = "dep-a", "job-1"
TOPIC = b"ctl:" + DEP.encode()


def lease(seq: int, dep: str = DEP) -> m.Lease:
    return m.Lease(deployment_id=dep, job_id=JOB, lease_seq=seq, ttl_s=10.0, cancel_epoch=0)


class FakeSession:
    """The report session as the intake sees it: who proved itself, how often."""

    def __init__(self) -> None:
        self.peer: Origin | None = None
        self.proofs = 0
        self.reauth_asked = 0

    def proved(self, chan: Channel) -> None:
        """The supervisor process that owns `chan` proved itself on report."""
        self.peer = Origin(chan.signer.sender, chan.signer.boot.partition(".")[0])
        self.proofs += 1

    def reauthenticate(self) -> None:
        self.reauth_asked += 1

    def heard(self, origin: Origin) -> None:
        self.heard_from = origin


def supervisor_process(key: Key, pid: int) -> Channel:
    """A supervisor process's control channel: its own sender and process boot id."""
    chan = Channel("supervisor", "control", sender=f"supervisor:host:{pid}", send_key=key)
    chan.signer.boot = f"{secrets.token_hex(8)}.{secrets.token_hex(3)}"  # a new process
    return chan


class Rig:
    def __init__(self) -> None:
        self.key = key = Key.from_secret(secrets.token_bytes(32))
        self.supervisor = Channel("supervisor", "control", sender="supervisor", send_key=key)
        self.chan = Channel("rank", "control", sender=f"{DEP}/rank-0", send_key=key,
                            accept=m.CONTROL)
        self.drops: collections.Counter[str] = collections.Counter()
        self.session = FakeSession()
        self.delivered: list = []
        self.intake = ControlIntake(self.chan, TOPIC, DEP, JOB, self.drops,
                                    session=self.session, deliver=self.delivered.append)

    def prove(self, chan: Channel | None = None) -> None:
        self.session.proved(chan or self.supervisor)

    def frames(self, body, *, channel: Channel | None = None) -> list[bytes]:
        return [TOPIC, (channel or self.supervisor).pack(body)]

    def feed(self, body, *, channel: Channel | None = None) -> None:
        self.intake.on_frames(self.frames(body, channel=channel))

    def counts(self) -> dict[str, int]:
        """As RankIO.reject_counts reports them (TELEMETRY.rejects, the marker)."""
        return {**self.drops, **{f"control.{r}": n for r, n in self.chan.rejects.snapshot().items()}}


def test_authentic_control_before_the_proof_is_held_not_counted():
    rig = Rig()
    rig.feed(lease(1))
    rig.feed(m.Serve(deployment_id=DEP, job_id=JOB))
    rig.feed(lease(2))  # replaces lease 1: the latest of each kind, in arrival order
    assert rig.delivered == [] and rig.intake.held == 2
    rig.intake.release()  # no proof yet: nothing moves
    assert rig.delivered == []
    rig.prove()
    rig.intake.release()
    assert rig.delivered == [m.Serve(deployment_id=DEP, job_id=JOB), lease(2)]
    rig.intake.release()  # delivered once
    rig.feed(lease(3))  # after the proof: at once
    assert rig.delivered[-1] == lease(3) and len(rig.delivered) == 3
    assert rig.counts() == {}  # a clean start rejects nothing


def test_a_message_after_the_proof_follows_what_was_held():
    rig = Rig()
    rig.feed(lease(1))
    rig.prove()  # proved, but no release yet
    rig.feed(m.Shutdown(deployment_id=DEP, job_id=JOB))
    assert rig.delivered == [lease(1), m.Shutdown(deployment_id=DEP, job_id=JOB)]


@pytest.mark.parametrize("verified", [False, True], ids=["before_proof", "after_proof"])
def test_forged_early_and_foreign_control_is_still_counted(verified):
    rig = Rig()
    if verified:
        rig.prove()
    forger = Channel("x", "control", sender="supervisor",
                     send_key=Key.from_secret(secrets.token_bytes(32)))
    rig.intake.on_frames(rig.frames(lease(1), channel=forger))  # another key
    tampered = bytearray(rig.supervisor.pack(lease(2)))
    tampered[-1] ^= 1
    rig.intake.on_frames([TOPIC, bytes(tampered)])  # this launch's key, altered bytes
    authentic = rig.frames(lease(3))
    rig.intake.on_frames(authentic)
    rig.intake.on_frames(authentic)  # the same message again
    rig.intake.on_frames([b"ctl:other", rig.supervisor.pack(lease(4))])  # wrong topic
    rig.feed(lease(5, dep="dep-b"))  # signed, but for another deployment
    assert rig.counts() == {"control.unknown_key": 1, "control.bad_mac": 1,
                            "control.replay": 1, "control.bad_frames": 1,
                            "control.wrong_deployment": 1}
    rig.prove()
    rig.intake.release()
    assert rig.delivered == [lease(3)]  # only the authentic one, once


# -- a restarted supervisor (adoption) --------------------------------------------------


def test_a_restarted_supervisor_is_held_until_it_proved_itself_then_replaces_the_old():
    rig = Rig()
    old, new = rig.supervisor, supervisor_process(rig.key, pid=2)
    rig.prove(old)
    rig.feed(lease(1))
    assert rig.delivered == [lease(1)] and rig.session.reauth_asked == 0
    # The old supervisor was killed; the new one binds the same endpoints, holds the
    # launch key (from disk), and publishes: authentic, but not yet proven.
    rig.feed(lease(1), channel=new)  # its own sequence: not a replay of the old one's
    rig.feed(m.Serve(deployment_id=DEP, job_id=JOB), channel=new)
    rig.feed(lease(2), channel=new)  # the latest per kind, as before any proof
    assert rig.delivered == [lease(1)] and rig.intake.held == 2
    assert rig.session.reauth_asked >= 1  # the report session handshakes again
    rig.feed(lease(9))  # the old one, still believed until the new one proved itself
    assert rig.delivered[-1] == lease(9)
    rig.prove(new)
    rig.intake.release()
    assert rig.delivered[2:] == [m.Serve(deployment_id=DEP, job_id=JOB), lease(2)]
    rig.feed(lease(3), channel=new)  # believed at once now
    assert rig.delivered[-1] == lease(3)
    asked = rig.session.reauth_asked
    rig.feed(lease(10))  # the old one's, still in flight: dropped and counted
    rig.feed(m.Shutdown(deployment_id=DEP, job_id=JOB))
    assert rig.delivered[-1] == lease(3) and rig.session.reauth_asked == asked
    assert rig.counts() == {"control.old_supervisor": 2}


def test_held_control_of_a_process_that_did_not_prove_itself_is_dropped():
    """Two origins held; the proof settles them: the prover's delivered, the other's
    dropped, counted, and refused from then on (it will not ask for a handshake again)."""
    rig = Rig()
    a, b = supervisor_process(rig.key, pid=2), supervisor_process(rig.key, pid=3)
    rig.feed(lease(1), channel=a)
    rig.feed(m.Serve(deployment_id=DEP, job_id=JOB), channel=b)
    rig.prove(b)
    rig.intake.release()
    assert rig.delivered == [m.Serve(deployment_id=DEP, job_id=JOB)]
    rig.feed(lease(2), channel=a)
    assert rig.session.reauth_asked == 0
    assert rig.counts() == {"control.old_supervisor": 2}


def test_a_restart_that_never_proves_itself_delivers_nothing_of_it():
    rig = Rig()
    rig.prove()
    new = supervisor_process(rig.key, pid=2)
    for seq in range(1, 50):
        rig.feed(lease(seq), channel=new)
    assert rig.delivered == [] and rig.intake.held == 1  # bounded: the latest lease
    assert rig.counts() == {}  # held, not counted
