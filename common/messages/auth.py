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
    nonce: bytes = field(metadata=HANDSHAKE_BYTES)  # responder's nonce
    # responder proves K(rank, "down") over the transcript (both nonces, ids)
    proof: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthProof:
    # initiator proves K(rank, "up") over the transcript
    proof: bytes = field(metadata=HANDSHAKE_BYTES)


@dataclass
class AuthOk:
    rank: int
