"""Ports chosen ahead of a rank's bind come from outside the ephemeral range (where every
outgoing connection's local port comes from), are distinct and bindable, and a taken one
is skipped; real sockets on loopback."""

from __future__ import annotations

import errno
import os
import random
import socket

import pytest

from common import ports


def test_the_range_is_below_the_ephemeral_one_else_above_else_none():
    assert ports.listen_range((32768, 60999)) == (ports.LOWEST, 32767)  # Linux default
    assert ports.listen_range((1024, 60999)) == (61000, 65535)
    assert ports.listen_range((1024, 65000)) is None


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    eph = ports.ephemeral_range()
    got = ports.free_ports(20, "127.0.0.1")
    assert len(set(got)) == 20
    assert all(not eph[0] <= p <= eph[1] for p in got), (eph, got)
    socks = []
    try:
        for p in got:  # free now: a listener can bind every one
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
            s.listen()
    finally:
        for s in socks:
            s.close()


class _Sequence(random.Random):
    """Draws the given ports in order (the first is the taken one)."""

    def __init__(self, seq: list[int]) -> None:
        super().__init__(0)
        self.seq = list(seq)

    def randint(self, a: int, b: int) -> int:
        return self.seq.pop(0)


def test_a_taken_port_is_skipped():
    lo, hi = ports.listen_range((32768, 60999))
    port = ports.free_ports(1, "127.0.0.1", ephemeral=(32768, 60999))[0]
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        other = ports.free_ports(1, "127.0.0.1", ephemeral=(32768, 60999))[0]
        rng = _Sequence([port, other])
        assert ports.free_ports(1, "127.0.0.1", ephemeral=(32768, 60999), rng=rng) == [other]
        assert lo <= other <= hi
    finally:
        taken.close()


def test_an_address_not_on_this_host_is_an_error_at_once():
    with pytest.raises(OSError) as exc:
        ports.free_ports(2, "192.0.2.1")  # TEST-NET-1: never a local address
    assert exc.value.errno == errno.EADDRNOTAVAIL


def test_a_configured_range_narrows_the_draw(monkeypatch):
    assert ports.configured_range({}) is None
    assert ports.configured_range({ports.RANGE_ENV: " 21000-21009 "}) == (21000, 21009)
    for bad in ("21000", "21000-", "a-b", "21010-21000", "0-10", "60000-70000"):
        with pytest.raises(ValueError, match=ports.RANGE_ENV):
            ports.configured_range({ports.RANGE_ENV: bad})
    monkeypatch.setenv(ports.RANGE_ENV, "21000-21009")
    got = ports.free_ports(5, "127.0.0.1")
    assert len(set(got)) == 5 and all(21000 <= p <= 21009 for p in got), got
    monkeypatch.setenv(ports.RANGE_ENV, "21000-21001")
    with pytest.raises(OSError, match="no 3 free TCP ports"):
        ports.free_ports(3, "127.0.0.1")


def test_within_overrides_the_configured_range(monkeypatch):
    monkeypatch.setenv(ports.RANGE_ENV, "21000-21009")
    got = ports.free_ports(4, "127.0.0.1", within=(21100, 21109))
    assert all(21100 <= p <= 21109 for p in got), got


def test_a_tests_own_ports_and_its_subprocesses_never_overlap():
    """tests/conftest.py: the test's draws and what up/supervisor inherit are disjoint,
    so a rank is never handed the port a test drew for a gateway not yet bound."""
    from tests.support.ports import TEST_RANGE_ENV, free_ports
    own = ports.configured_range({ports.RANGE_ENV: os.environ[TEST_RANGE_ENV]})
    theirs = ports.configured_range()
    assert own and theirs and (own[1] < theirs[0] or theirs[1] < own[0]), (own, theirs)
    assert all(own[0] <= p <= own[1] for p in free_ports(8))


def test_each_xdist_worker_draws_from_its_own_slice():
    """Worker i of n holds the i-th n-th of the range (both halves): the controller must
    not set one slice every worker inherits."""
    from tests.support.ports import TEST_RANGE_ENV
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = ports.listen_range(ports.ephemeral_range())
    assert span is not None
    width = (span[1] - span[0] + 1) // count
    low = span[0] + int(worker[2:]) * width
    own = ports.configured_range({ports.RANGE_ENV: os.environ[TEST_RANGE_ENV]})
    theirs = ports.configured_range()
    assert own and theirs and (own[0], theirs[1]) == (low, low + width - 1), (worker, own, theirs)
