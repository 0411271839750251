"""tests/gwutil.poll_until: errors keep it polling (reported at its deadline), except
GaveUp, which fails it at once (a `lockstep up` that exited must not cost the deadline)."""

from __future__ import annotations

import time

import pytest

from tests.gwutil import GaveUp, poll_until


def test_an_error_keeps_polling_until_the_value_comes():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "ready"

    assert poll_until(flaky, 10, "flaky", interval=0.01) == "ready"
    assert len(calls) == 3


def test_gave_up_fails_at_once_not_at_the_deadline():
    def exited():
        raise GaveUp("lockstep up exited: ...")

    t0 = time.monotonic()
    with pytest.raises(GaveUp, match="exited"):
        poll_until(exited, 300, "never", interval=0.01)
    assert time.monotonic() - t0 < 5
