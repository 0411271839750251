"""Errors of the rank service, typed by cause."""

from __future__ import annotations

import enum


class RankError(Exception):
    """A rank cannot continue (it fails closed: marker `failed`)."""


class StartupError(RankError):
    """Start-up cannot go on: the spec and the distributed group disagree, or a layout
    the rank does not support."""


class StepCause(enum.Enum):
    """Why a step (`engine.next()`, a collective with every peer) raised."""

    PEER_LOST = "peer_lost"  # the connection to a peer broke: it died or was cut off
    FAILED = "failed"  # anything else: this rank fails closed


def step_cause(exc: BaseException) -> StepCause:
    """The one classifier of exceptions out of an MLX step. MLX's distributed backends
    raise a plain RuntimeError whose only clue is its text (ring: "[ring] connection to
    a peer was lost"; a reset socket: "... connection reset ..."), so this function —
    and nothing else in the tree — reads it; callers act on the typed cause."""
    if isinstance(exc, ConnectionError):
        return StepCause.PEER_LOST
    text = str(exc).lower()
    if "peer" in text or "connection" in text:
        return StepCause.PEER_LOST
    return StepCause.FAILED
