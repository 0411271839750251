"""Session handshake (common/handshake.py) on the plan and report sockets, signed with
that socket's key: AUTH_HELLO → AUTH_CHALLENGE → AUTH_PROOF → AUTH_OK.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HANDSHAKE_BYTES = {"max_len": 64}  # nonces are 16 bytes, proofs 32 (common/handshake.py)


@dataclass
class AuthHello:
    deployment_id: str
    job_id: str
    rank: int
    nonce: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthChallenge:
    # responder's nonce: a cookie, HMAC(its secret, identity, rank, n_i, issued), so the
    # responder keeps no state per HELLO (common/handshake.py)
    nonce: bytes = field(metadata=HANDSHAKE_BYTES)
    # responder proves K(rank, "down") over the transcript (both nonces, ids)
    proof: bytes = field(metadata=HANDSHAKE_BYTES)
    issued_ms: int  # the responder's clock when it issued the cookie (echoed back)


@dataclass
class AuthProof:
    # initiator proves K(rank, "up") over the transcript
    proof: bytes = field(metadata=HANDSHAKE_BYTES)
    # the exchange echoed back, so the responder re-derives it instead of storing it
    rank: int
    nonce_i: bytes = field(metadata=HANDSHAKE_BYTES)
    nonce_r: bytes = field(metadata=HANDSHAKE_BYTES)
    issued_ms: int


@dataclass
class AuthOk:
    rank: int
