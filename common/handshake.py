"""Mutual challenge–response for rank sessions (DESIGN.md §3, docs/security.md).
Pure logic: no sockets, no threads; every check is O(1).

    initiator (rank r, DEALER)                       responder (rank 0 / supervisor, ROUTER)
    AUTH_HELLO {deployment, job, r, n_i}        →
                                                ←    AUTH_CHALLENGE {n_r, p_r}
    check p_r = HMAC(K(r, "down"), "R" ‖ T)
    AUTH_PROOF {p_i = HMAC(K(r, "up"), "I" ‖ T)} →
                                                     check p_i: the ROUTER identity is rank r
                                                ←    AUTH_OK {r}

    T = length-prefixed (label, channel, deployment, job, r, routing identity, n_i, n_r)

K(r, d) = `LaunchKeys.session(r, d)`: HKDF of the launch secret bound to deployment, job,
rank and direction. The envelope around each message is signed with the channel key as
usual (plan or report), so an outsider is refused at the MAC before any of this runs;
the handshake then proves, both ways, possession of rank r's session keys *for this
exchange*: both nonces are fresh, the routing identity is bound, the two directions use
different keys and labels (a proof cannot be reflected), and the channel name is bound
(a proof for the plan socket is no good on the report socket).

Policy (documented in docs/security.md): a rank authenticated under one identity is not
replaced by another identity (`duplicate_rank`); the same identity may repeat the
handshake. The responder keeps nothing per HELLO: its challenge nonce is a cookie
(`Responder`), good for `DEADLINE_S`; memory is spent only on authenticated identities.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from common.envelope import Key, Message, Reason
from common.messages import AuthChallenge, AuthHello, AuthOk, AuthProof, Kind

LABEL = b"lockstep-session/v1"
NONCE_LEN = 16
PROOF_LEN = 32
DEADLINE_S = 5.0
KeysFor = Callable[[int], "tuple[Key, Key]"]  # rank -> (up, down)


class AuthError(Exception):
    def __init__(self, reason: Reason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


def transcript(channel: str, deployment_id: str, job_id: str, rank: int, identity: bytes,
               nonce_i: bytes, nonce_r: bytes) -> bytes:
    parts = (LABEL, channel.encode(), deployment_id.encode(), job_id.encode(),
             str(rank).encode(), identity, nonce_i, nonce_r)
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def prove(key: Key, role: bytes, t: bytes) -> bytes:
    return hmac.new(key.secret, role + t, hashlib.sha256).digest()


def _nonce_ok(n: object) -> bool:
    return type(n) is bytes and len(n) == NONCE_LEN


class Initiator:
    """Rank r's side. `identity` is the routing id its DEALER presents to the ROUTER."""

    def __init__(self, channel: str, deployment_id: str, job_id: str, rank: int,
                 identity: bytes, up: Key, down: Key, *, nonce: bytes | None = None) -> None:
        self.channel, self.deployment_id, self.job_id, self.rank = \
            channel, deployment_id, job_id, rank
        self.identity = identity
        self._up, self._down = up, down
        self.nonce = nonce or secrets.token_bytes(NONCE_LEN)
        self.peer_verified = False  # the responder proved K(r, down) for our nonce
        self.accepted = False  # the responder accepted our proof (AUTH_OK)
        self._proof: AuthProof | None = None
        self._nonce_r: bytes | None = None

    def hello(self) -> AuthHello:
        return AuthHello(deployment_id=self.deployment_id, job_id=self.job_id, rank=self.rank,
                         nonce=self.nonce)

    def on_challenge(self, ch: AuthChallenge) -> AuthProof:
        if self._proof is not None and ch.nonce == self._nonce_r:
            return self._proof  # the same challenge again (our HELLO was re-sent)
        if not _nonce_ok(ch.nonce):
            raise AuthError(Reason.BAD_NONCE)
        t = transcript(self.channel, self.deployment_id, self.job_id, self.rank, self.identity,
                       self.nonce, ch.nonce)
        if len(ch.proof) != PROOF_LEN or not hmac.compare_digest(
                prove(self._down, b"R", t), ch.proof):
            raise AuthError(Reason.BAD_PROOF, "responder")
        self.peer_verified = True
        self._nonce_r = ch.nonce
        self._proof = AuthProof(proof=prove(self._up, b"I", t), rank=self.rank,
                                nonce_i=self.nonce, nonce_r=ch.nonce, issued_ms=ch.issued_ms)
        return self._proof

    def on_ok(self, ok: AuthOk) -> None:
        if not self.peer_verified:
            raise AuthError(Reason.UNAUTHENTICATED, "AUTH_OK before a verified challenge")
        if ok.rank != self.rank:
            raise AuthError(Reason.WRONG_PEER, f"AUTH_OK for rank {ok.rank}")
        self.accepted = True


def _cookie(secret: bytes, identity: bytes, rank: int, nonce_i: bytes, issued_ms: int) -> bytes:
    parts = (identity, str(rank).encode(), nonce_i, str(issued_ms).encode())
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(secret, msg, hashlib.sha256).digest()[:NONCE_LEN]


class Responder:
    """Rank 0 (plan, ranks 1..N-1) or the supervisor (report, ranks 0..N-1).

    Stateless until a proof verifies, as TCP's SYN cookies: the challenge nonce is an HMAC,
    under a secret of this responder's own, of (identity, rank, n_i, issued_ms), and the
    initiator echoes all of it in its proof. A flood of HELLOs (even with the channel key)
    therefore holds no memory and can evict no honest handshake; a proof is good for
    `deadline_s` after its challenge was issued."""

    def __init__(self, channel: str, deployment_id: str, job_id: str, ranks: range,
                 keys_for: KeysFor, *, deadline_s: float = DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.channel, self.deployment_id, self.job_id = channel, deployment_id, job_id
        self.ranks = ranks
        self._keys = {r: keys_for(r) for r in ranks}  # derived once: O(1) per handshake
        self._secret = secrets.token_bytes(32)  # this responder's cookies only
        self.deadline_ms = int(deadline_s * 1000)
        self._clock = clock
        self.peers: dict[bytes, int] = {}  # authenticated identity -> rank
        self.by_rank: dict[int, bytes] = {}  # rank -> authenticated identity
        self._done: dict[bytes, tuple[int, bytes]] = {}  # identity -> (rank, accepted proof)

    def rank_of(self, identity: bytes) -> int | None:
        return self.peers.get(identity)

    def _check_claim(self, identity: bytes, rank: int) -> None:
        if rank not in self._keys:
            raise AuthError(Reason.BAD_RANK, str(rank))
        known = self.peers.get(identity)
        if known is not None and known != rank:
            raise AuthError(Reason.WRONG_PEER, f"identity is rank {known}, claims {rank}")
        holder = self.by_rank.get(rank)
        if holder is not None and holder != identity:
            raise AuthError(Reason.DUPLICATE_RANK, f"rank {rank} is already authenticated")

    def on_hello(self, identity: bytes, hello: AuthHello) -> AuthChallenge:
        if hello.deployment_id != self.deployment_id or hello.job_id != self.job_id:
            raise AuthError(Reason.WRONG_LAUNCH, f"{hello.deployment_id[:64]}/{hello.job_id[:64]}")
        if not _nonce_ok(hello.nonce):
            raise AuthError(Reason.BAD_NONCE)
        rank = hello.rank
        self._check_claim(identity, rank)
        issued_ms = int(self._clock() * 1000)
        nonce_r = _cookie(self._secret, identity, rank, hello.nonce, issued_ms)
        t = transcript(self.channel, self.deployment_id, self.job_id, rank, identity,
                       hello.nonce, nonce_r)
        return AuthChallenge(nonce=nonce_r, proof=prove(self._keys[rank][1], b"R", t),
                             issued_ms=issued_ms)

    def on_proof(self, identity: bytes, proof: AuthProof) -> AuthOk:
        done = self._done.get(identity)
        if done is not None and hmac.compare_digest(done[1], proof.proof):
            return AuthOk(rank=done[0])  # our AUTH_OK crossed a re-sent proof
        if proof.rank not in self._keys or not _nonce_ok(proof.nonce_i) \
                or not _nonce_ok(proof.nonce_r) or not hmac.compare_digest(
                    _cookie(self._secret, identity, proof.rank, proof.nonce_i,
                            proof.issued_ms), proof.nonce_r):
            raise AuthError(Reason.NO_HANDSHAKE)  # not a challenge we issued to identity
        age_ms = int(self._clock() * 1000) - proof.issued_ms
        if not 0 <= age_ms < self.deadline_ms:
            raise AuthError(Reason.HANDSHAKE_EXPIRED, f"rank {proof.rank}, {age_ms} ms")
        t = transcript(self.channel, self.deployment_id, self.job_id, proof.rank, identity,
                       proof.nonce_i, proof.nonce_r)
        if len(proof.proof) != PROOF_LEN or not hmac.compare_digest(
                prove(self._keys[proof.rank][0], b"I", t), proof.proof):
            raise AuthError(Reason.BAD_PROOF, f"rank {proof.rank}")
        self._check_claim(identity, proof.rank)  # another identity may have won meanwhile
        self.peers[identity] = proof.rank
        self.by_rank[proof.rank] = identity
        self._done[identity] = (proof.rank, proof.proof)  # one per authenticated identity
        return AuthOk(rank=proof.rank)

    def forget(self, rank: int) -> None:
        """Drop rank's authentication (the rank is gone); it must handshake again."""
        ident = self.by_rank.pop(rank, None)
        if ident is not None:
            self.peers.pop(ident, None)
            self._done.pop(ident, None)


class Gate:
    """A ROUTER's admission for one launch: the handshake, then identity → rank.

    `chan` is the socket's `common.bus.Channel` (verifies the envelope, counts and charges
    rejections); `send(identity, body)` sends a handshake reply without blocking."""

    def __init__(self, chan, responder: Responder,
                 send: Callable[[bytes, object], None]) -> None:
        self.chan, self.responder, self._send = chan, responder, send

    def admit(self, frames: list[bytes]) -> tuple[bytes, Message, int] | None:
        got = self.chan.unpack_router(frames)
        return None if got is None else self.admit_message(*got)

    def admit_message(self, ident: bytes, msg: Message) -> tuple[bytes, Message, int] | None:
        """(identity, message, rank) for a message from an authenticated peer speaking for
        its own rank; None for a handshake message (answered here) or a rejection."""
        kind, body = msg.kind, msg.body
        if kind is Kind.AUTH_HELLO or kind is Kind.AUTH_PROOF:
            self.chan.charge()
            try:
                reply = self.responder.on_hello(ident, body) if kind is Kind.AUTH_HELLO \
                    else self.responder.on_proof(ident, body)
            except AuthError as exc:
                self.chan.reject(exc.reason, exc.detail)
                return None
            self._send(ident, reply)
            return None
        rank = self.responder.peers.get(ident)
        if rank is None:
            self.chan.reject(Reason.UNAUTHENTICATED, kind.value)
            return None
        claimed = getattr(body, "rank", rank)
        if claimed != rank:
            self.chan.reject(Reason.WRONG_PEER, f"rank {rank} sent {kind.value} as {claimed}")
            return None
        return ident, msg, rank


def session_keys(launch_keys, rank: int) -> tuple[Key, Key]:
    """(up, down) session keys of `rank` from a `common.keys.LaunchKeys`."""
    return launch_keys.session(rank, "up"), launch_keys.session(rank, "down")
