"""The rank's control intake (services/rank/control_intake.py), fed real signed frames:
an authentic control message that arrives before the supervisor's proof is held (not
counted) and delivered after it; anything forged, tampered, replayed, mis-framed or for
another deployment is counted exactly as before, proof or no proof."""

from __future__ import annotations

import collections
import secrets

import pytest

from common import messages as m
from common.bus import Channel
from common.envelope import Key
from services.rank.control_intake import ControlIntake

DEP, JOB = "dep-a", "job-1"
TOPIC = b"ctl:" + DEP.encode()


def lease(seq: int, dep: str = DEP) -> m.Lease:
    return m.Lease(deployment_id=dep, job_id=JOB, lease_seq=seq, ttl_s=10.0, cancel_epoch=0)


class Rig:
    def __init__(self) -> None:
        key = Key.from_secret(secrets.token_bytes(32))
        self.supervisor = Channel("supervisor", "control", sender="supervisor", send_key=key)
        self.chan = Channel("rank", "control", sender=f"{DEP}/rank-0", send_key=key,
                            accept=m.CONTROL)
        self.drops: collections.Counter[str] = collections.Counter()
        self.verified = False
        self.delivered: list = []
        self.intake = ControlIntake(self.chan, TOPIC, DEP, JOB, self.drops,
                                    verified=lambda: self.verified,
                                    deliver=self.delivered.append)

    def frames(self, body, *, channel: Channel | None = None) -> list[bytes]:
        return [TOPIC, (channel or self.supervisor).pack(body)]

    def feed(self, body) -> None:
        self.intake.on_frames(self.frames(body))

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
    rig.verified = True
    rig.intake.release()
    assert rig.delivered == [m.Serve(deployment_id=DEP, job_id=JOB), lease(2)]
    rig.intake.release()  # delivered once
    rig.feed(lease(3))  # after the proof: at once
    assert rig.delivered[-1] == lease(3) and len(rig.delivered) == 3
    assert rig.counts() == {}  # a clean start rejects nothing


def test_a_message_after_the_proof_follows_what_was_held():
    rig = Rig()
    rig.feed(lease(1))
    rig.verified = True  # proved, but no release yet
    rig.feed(m.Shutdown(deployment_id=DEP, job_id=JOB))
    assert rig.delivered == [lease(1), m.Shutdown(deployment_id=DEP, job_id=JOB)]


@pytest.mark.parametrize("verified", [False, True], ids=["before_proof", "after_proof"])
def test_forged_early_and_foreign_control_is_still_counted(verified):
    rig = Rig()
    rig.verified = verified
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
    rig.verified = True
    rig.intake.release()
    assert rig.delivered == [lease(3)]  # only the authentic one, once
