"""Errors of the rank service."""

from __future__ import annotations


class RankError(Exception):
    """A rank cannot continue; `phase` is the marker phase it exits with."""

    def __init__(self, message: str, phase: str = "failed") -> None:
        super().__init__(message)
        self.phase = phase


class StartupError(RankError):
    pass
