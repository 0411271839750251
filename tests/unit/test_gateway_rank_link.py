"""The gateway's verdict on its link to rank 0 (services/gateway/core/rank_link.py), pure:
monitor events and `now` in, a typed state out."""

from __future__ import annotations

import zmq

from services.gateway.core.rank_link import DEALER_OPTIONS, Link, LinkState

EP = "tcp://10.0.0.2:5555"


def test_a_disconnect_is_one_loss_and_the_state_says_why():
    s = LinkState(EP)
    assert s.link is Link.CONNECTING
    assert not s.observe(zmq.EVENT_HANDSHAKE_SUCCEEDED, 1.0)
    assert s.link is Link.UP and s.up_at == 1.0
    assert s.observe(zmq.EVENT_DISCONNECTED, 2.0)  # the caller fails its streams once
    assert s.link is Link.LOST and s.lost_at == 2.0 and EP in (s.reason or "")
    assert not s.observe(zmq.EVENT_DISCONNECTED, 2.5)  # not twice
    assert not s.back_since_loss()


def test_a_disconnect_before_any_handshake_seen_is_a_loss_too():
    # The monitor may start after the first handshake: a loss must not depend on it.
    s = LinkState(EP)
    assert s.observe(zmq.EVENT_DISCONNECTED, 5.0)
    assert s.link is Link.LOST


def test_back_since_loss_only_after_a_handshake_that_follows_the_loss():
    s = LinkState(EP)
    s.observe(zmq.EVENT_HANDSHAKE_SUCCEEDED, 1.0)
    s.observe(zmq.EVENT_DISCONNECTED, 2.0)
    s.observe(zmq.EVENT_CONNECT_RETRIED, 3.0)  # other events change nothing
    assert s.link is Link.LOST and not s.back_since_loss()
    s.observe(zmq.EVENT_HANDSHAKE_SUCCEEDED, 4.0)
    assert s.link is Link.UP and s.back_since_loss()
    assert s.observe(zmq.EVENT_DISCONNECTED, 6.0)  # lost again: a new loss
    assert not s.back_since_loss()


def test_the_dealer_heartbeats_so_a_silent_host_is_a_disconnect():
    assert DEALER_OPTIONS[zmq.HEARTBEAT_IVL] > 0
    assert DEALER_OPTIONS[zmq.HEARTBEAT_TIMEOUT] > DEALER_OPTIONS[zmq.HEARTBEAT_IVL]
