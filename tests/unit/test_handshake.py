"""The session handshake (common/handshake.py) and its admission gate: every refusal has
its own reason, nothing is ever accepted without both proofs, and whatever bytes arrive
the decoders only ever reject (hypothesis)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import messages as m
from common.bus import Channel
from common.envelope import MAGIC, PREFIX, PROTOCOL_VERSION, Reason, Signer
from common.handshake import (
    NONCE_LEN,
    AuthError,
    Gate,
    Initiator,
    Responder,
    prove,
    session_keys,
    transcript,
)
from common.keys import LaunchKeys
from tests.support.clock import FakeClock

SECRET = b"s" * 32
LK = LaunchKeys(SECRET, "dep-1", "job-1")
STALE = LaunchKeys(b"t" * 32, "dep-1", "job-1")  # another launch's secret, same ids
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def responder(channel: str = "plan", *, keys: LaunchKeys = LK, clock=None, **kw) -> Responder:
    return Responder(channel, "dep-1", "job-1", range(1, 4), lambda r: session_keys(keys, r),
                     clock=clock or FakeClock(100.0), **kw)


def initiator(rank: int = 1, ident: bytes = b"id-1", *, keys: LaunchKeys = LK,
              channel: str = "plan") -> Initiator:
    up, down = session_keys(keys, rank)
    return Initiator(channel, "dep-1", "job-1", rank, ident, up, down)


def handshake(resp: Responder, init: Initiator) -> m.AuthOk:
    ch = resp.on_hello(init.identity, init.hello())
    ok = resp.on_proof(init.identity, init.on_challenge(ch))
    init.on_ok(ok)
    return ok


def reason_of(fn, *args) -> Reason:
    with pytest.raises(AuthError) as exc:
        fn(*args)
    return exc.value.reason


def test_mutual_authentication_binds_identity_and_rank():
    resp, init = responder(), initiator(2, b"id-2")
    assert handshake(resp, init) == m.AuthOk(rank=2)
    assert init.peer_verified and init.accepted
    assert resp.rank_of(b"id-2") == 2 and resp.by_rank == {2: b"id-2"}


def test_nothing_is_accepted_before_both_proofs():
    init = initiator()
    assert reason_of(init.on_ok, m.AuthOk(rank=1)) is Reason.UNAUTHENTICATED
    resp = responder()
    resp.on_hello(b"id-1", init.hello())
    assert resp.rank_of(b"id-1") is None  # a HELLO alone authenticates nothing


def test_stale_secret_fails_both_ways():
    """A rank of an older launch (other secret): its proof fails at the responder, and a
    responder of an older launch fails at the initiator."""
    resp, stale = responder(), initiator(keys=STALE)
    ch = resp.on_hello(b"id-1", stale.hello())
    assert reason_of(stale.on_challenge, ch) is Reason.BAD_PROOF  # we don't trust them
    t = transcript("plan", "dep-1", "job-1", 1, b"id-1", stale.nonce, ch.nonce)
    forged = m.AuthProof(prove(STALE.session(1, "up"), b"I", t), 1, stale.nonce, ch.nonce,
                         ch.issued_ms)  # our own challenge echoed, the old launch's key
    assert reason_of(resp.on_proof, b"id-1", forged) is Reason.BAD_PROOF
    old_resp, init = responder(keys=STALE), initiator()
    assert reason_of(init.on_challenge, old_resp.on_hello(b"id-1", init.hello())) \
        is Reason.BAD_PROOF
    assert not init.peer_verified


def test_proof_is_bound_to_the_routing_identity():
    """A proof relayed from another connection (identity) does not verify."""
    resp, init = responder(), initiator(1, b"id-1")
    ch = resp.on_hello(b"id-1", init.hello())
    proof = init.on_challenge(ch)
    resp.on_hello(b"mallory", init.hello())  # replayed HELLO from another connection
    # the cookie binds the identity it was issued to
    assert reason_of(resp.on_proof, b"mallory", proof) is Reason.NO_HANDSHAKE
    theirs = resp.on_hello(b"mallory", init.hello())  # even echoing mallory's own cookie
    relayed = dataclasses.replace(proof, nonce_r=theirs.nonce, issued_ms=theirs.issued_ms)
    assert reason_of(resp.on_proof, b"mallory", relayed) is Reason.BAD_PROOF
    assert resp.rank_of(b"mallory") is None


def test_reflection_and_cross_channel_proofs_fail():
    resp, init = responder(), initiator()
    ch = resp.on_hello(b"id-1", init.hello())
    # the responder's own proof sent back
    reflected = m.AuthProof(ch.proof, 1, init.nonce, ch.nonce, ch.issued_ms)
    assert reason_of(resp.on_proof, b"id-1", reflected) is Reason.BAD_PROOF
    report = responder("report")
    ch2 = report.on_hello(b"id-1", init.hello())  # a report-socket challenge
    assert reason_of(init.on_challenge, ch2) is Reason.BAD_PROOF  # we speak plan


def test_replayed_handshake_is_refused():
    resp, init = responder(), initiator()
    ch = resp.on_hello(b"id-1", init.hello())
    proof = init.on_challenge(ch)
    resp.on_proof(b"id-1", proof)
    # the same proof again from the same connection (it crossed our AUTH_OK): idempotent
    assert resp.on_proof(b"id-1", proof) == m.AuthOk(rank=1)
    assert reason_of(resp.on_proof, b"id-2", proof) is Reason.NO_HANDSHAKE
    # A fresh responder (a later boot) and the recorded HELLO + PROOF: new nonce, no good.
    later = responder()
    later.on_hello(b"id-1", init.hello())
    assert reason_of(later.on_proof, b"id-1", proof) is Reason.NO_HANDSHAKE  # not its cookie


def test_another_ranks_identity_is_refused():
    resp = responder()
    handshake(resp, initiator(1, b"id-1"))
    # a second connection claiming rank 1 (even with the right keys)
    assert reason_of(resp.on_hello, b"id-x", initiator(1, b"id-x").hello()) \
        is Reason.DUPLICATE_RANK
    # the authenticated identity claiming another rank
    assert reason_of(resp.on_hello, b"id-1", initiator(2, b"id-1").hello()) is Reason.WRONG_PEER
    # rank 2's keys, claiming rank 3: the proof does not verify
    up, down = session_keys(LK, 2)
    liar = Initiator("plan", "dep-1", "job-1", 3, b"id-3", up, down)
    ch = resp.on_hello(b"id-3", liar.hello())
    assert reason_of(liar.on_challenge, ch) is Reason.BAD_PROOF
    # the same identity may repeat its handshake
    assert handshake(resp, initiator(1, b"id-1")).rank == 1


def test_duplicate_decided_at_proof_time_too():
    resp = responder()
    a, b = initiator(1, b"a"), initiator(1, b"b")
    ch_b = resp.on_hello(b"b", b.hello())
    handshake(resp, a)
    assert reason_of(resp.on_proof, b"b", b.on_challenge(ch_b)) is Reason.DUPLICATE_RANK
    assert resp.by_rank == {1: b"a"}


@pytest.mark.parametrize(("hello", "reason"), [
    (m.AuthHello("dep-2", "job-1", 1, b"n" * NONCE_LEN), Reason.WRONG_LAUNCH),
    (m.AuthHello("dep-1", "job-0", 1, b"n" * NONCE_LEN), Reason.WRONG_LAUNCH),
    (m.AuthHello("dep-1", "job-1", 0, b"n" * NONCE_LEN), Reason.BAD_RANK),
    (m.AuthHello("dep-1", "job-1", 9, b"n" * NONCE_LEN), Reason.BAD_RANK),
    (m.AuthHello("dep-1", "job-1", 1, b"short"), Reason.BAD_NONCE),
])
def test_bad_hellos(hello, reason):
    assert reason_of(responder().on_hello, b"id", hello) is reason


def test_resent_hello_gets_an_equivalent_challenge():
    clock = FakeClock(100.0)
    resp, init = responder(clock=clock), initiator()
    ch1 = resp.on_hello(b"id-1", init.hello())
    assert resp.on_hello(b"id-1", init.hello()) == ch1  # same millisecond, same cookie
    p1 = init.on_challenge(ch1)
    assert init.on_challenge(ch1) is p1  # idempotent on the initiator side too
    clock.now += 0.5  # a HELLO re-sent later: another cookie, and either proof is good
    ch2 = resp.on_hello(b"id-1", init.hello())
    assert ch2.nonce != ch1.nonce
    p2 = init.on_challenge(ch2)
    assert resp.on_proof(b"id-1", p1) == resp.on_proof(b"id-1", p2) == m.AuthOk(rank=1)


def test_a_hello_flood_holds_no_state_and_cannot_evict_an_honest_handshake():
    resp = responder()
    legit = initiator(1, b"legit")
    ch = resp.on_hello(b"legit", legit.hello())
    before = {k: len(v) for k, v in vars(resp).items() if isinstance(v, dict)}
    for i in range(1000):  # half-open handshakes from 1000 identities, with the keys
        resp.on_hello(b"h%d" % i, initiator(2, b"h%d" % i).hello())
    assert {k: len(v) for k, v in vars(resp).items() if isinstance(v, dict)} == before
    assert resp.on_proof(b"legit", legit.on_challenge(ch)).rank == 1


def test_a_proof_must_echo_the_challenge_it_was_given():
    resp, init = responder(), initiator()
    proof = init.on_challenge(resp.on_hello(b"id-1", init.hello()))
    for forged in (dataclasses.replace(proof, issued_ms=proof.issued_ms + 1),
                   dataclasses.replace(proof, rank=2),
                   dataclasses.replace(proof, nonce_i=b"x" * NONCE_LEN),
                   dataclasses.replace(proof, nonce_r=b"x" * NONCE_LEN),
                   dataclasses.replace(proof, nonce_r=b"short")):
        assert reason_of(resp.on_proof, b"id-1", forged) is Reason.NO_HANDSHAKE
    assert reason_of(resp.on_proof, b"id-2", proof) is Reason.NO_HANDSHAKE  # another socket
    assert resp.on_proof(b"id-1", proof).rank == 1


def test_challenge_deadline():
    clock = FakeClock(100.0)
    resp, init = responder(clock=clock, deadline_s=5.0), initiator()
    ch = resp.on_hello(b"id-1", init.hello())
    clock.now += 5.0
    assert reason_of(resp.on_proof, b"id-1", init.on_challenge(ch)) is Reason.HANDSHAKE_EXPIRED
    clock.now -= 0.001  # just inside it
    assert resp.on_proof(b"id-1", init.on_challenge(ch)).rank == 1


def test_forget_requires_a_new_handshake():
    resp = responder()
    handshake(resp, initiator(1, b"a"))
    resp.forget(1)
    assert resp.rank_of(b"a") is None
    assert handshake(resp, initiator(1, b"b")).rank == 1


def test_transcript_is_length_prefixed():
    a = transcript("plan", "d", "j", 1, b"ab", b"c" * 16, b"d" * 16)
    b = transcript("plan", "d", "j", 1, b"a", b"bc" * 8 + b"c", b"d" * 16)
    assert a != b


# --- the gate on a ROUTER: envelope, handshake, then identity -> rank -------------------


class Wire:
    """A fake ROUTER: the gate's replies, and frames as a peer would send them."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send(self, ident: bytes, body: object) -> None:
        self.sent.append((ident, body))


def gate() -> tuple[Gate, Channel, Wire]:
    chan = Channel("test", "plan-gate-" + secrets.token_hex(3), sender="rank-0",
                   send_key=LK.plan, accept=m.PLAN_TO_LEADER)
    w = Wire()
    resp = Responder("plan", "dep-1", "job-1", range(1, 3), lambda r: session_keys(LK, r))
    return Gate(chan, resp, w.send), chan, w


def test_gate_lets_only_authenticated_peers_through():
    g, chan, w = gate()
    follower = Signer(LK.plan, "dep-1/rank-1")
    init = initiator(1, b"f1")
    assert g.admit([b"f1", follower.encode(m.PlanHello(rank=1))]) is None
    assert chan.rejects.snapshot() == {"unauthenticated": 1}
    assert g.admit([b"f1", follower.encode(init.hello())]) is None
    ch = w.sent[-1][1]
    assert g.admit([b"f1", follower.encode(init.on_challenge(ch))]) is None
    assert w.sent[-1] == (b"f1", m.AuthOk(rank=1))
    ident, msg, rank = g.admit([b"f1", follower.encode(m.PlanHello(rank=1))])
    assert (ident, rank, msg.body) == (b"f1", 1, m.PlanHello(rank=1))
    assert g.admit([b"f1", follower.encode(m.Pong(1, 2, 0, "serving"))]) is None
    assert chan.rejects.snapshot()["wrong_peer"] == 1
    stale = Signer(STALE.plan, "old")
    assert g.admit([b"x", stale.encode(initiator(2, b"x", keys=STALE).hello())]) is None
    assert chan.rejects.snapshot()["unknown_key"] == 1
    assert g.admit([b"f1", b"garbage"]) is None and g.admit([b"only-one-frame"]) is None
    assert {"too_short", "bad_frames"} <= set(chan.rejects.snapshot())


# --- fuzzing every decoder entry point of the handshake ------------------------------------

nonces = st.binary(min_size=0, max_size=70) | st.just(b"n" * NONCE_LEN)
texts = st.text(max_size=20) | st.sampled_from(["dep-1", "job-1"])
bodies = st.one_of(
    st.builds(m.AuthHello, texts, texts, st.integers(-5, 10), nonces),
    st.builds(m.AuthProof, st.binary(max_size=70), st.integers(-5, 10), nonces, nonces,
              st.integers(-2**40, 2**50)),
    st.builds(m.AuthChallenge, nonces, st.binary(max_size=70), st.integers(-2**40, 2**50)),
    st.builds(m.AuthOk, st.integers(-5, 10)),
    st.builds(m.PlanHello, st.integers(-5, 10)),
)
ints64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
leaves = st.none() | st.booleans() | ints64 | st.binary(max_size=40) | st.text(max_size=20)
raw_values = st.recursive(leaves, lambda c: st.lists(c, max_size=4)
                          | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=12)
# maps with the real field names and arbitrary values (reach the per-field checks)
shaped = st.one_of(*(st.fixed_dictionaries({f: leaves for f in fields},
                                           optional={"extra": leaves})
                     for fields in (("deployment_id", "job_id", "rank", "nonce"),
                                    ("nonce", "proof"), ("proof",), ("rank",))))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), bodies), max_size=12))
def test_fuzz_gate_sequences_never_authenticate_without_keys(seq):
    """Any sequence of well-formed handshake messages from peers holding the channel key
    but not the session keys: the gate answers or rejects with a Reason, never raises,
    and never lets anyone through."""
    g, chan, _w = gate()
    signer = Signer(LK.plan, "mallory")
    for ident, body in seq:
        assert g.admit([ident, signer.encode(body)]) is None
    assert not g.responder.peers
    assert set(chan.rejects.snapshot()) <= {r.value for r in Reason}


@FUZZ
@given(st.sampled_from([m.AuthHello, m.AuthChallenge, m.AuthProof, m.AuthOk]),
       raw_values | shaped)
def test_fuzz_handshake_bodies_decode_or_reject(cls, raw):
    """Arbitrary msgpack values as a handshake body, signed with the right key."""
    g, chan, _w = gate()
    hdr = msgpack.packb([m.KIND_OF[cls].value, "fuzzer", secrets.token_hex(4), 1, time.time()])
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, LK.plan.key_id, len(hdr))
    signed = prefix + hdr + msgpack.packb(raw)
    frame = signed + hmac.new(LK.plan.secret, signed, hashlib.sha256).digest()
    assert g.admit([b"z", frame]) is None
    assert not g.responder.peers


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=80))
def test_fuzz_initiator_challenge(nonce, proof):
    init = initiator()
    try:
        init.on_challenge(m.AuthChallenge(nonce, proof, 0))
    except AuthError as exc:
        assert exc.reason in (Reason.BAD_NONCE, Reason.BAD_PROOF)
    assert not init.peer_verified
