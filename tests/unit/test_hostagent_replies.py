"""A host agent's answers are decoded once (services/hostagent/replies.py): a probe's
states and markers come back typed, and an answer that is not the command's reply is an
SshError naming the host and the field, never a KeyError in a reader."""

from __future__ import annotations

import pytest

from common.messages.vocab import ProcState
from common.procs import ProcessIdentity
from common.records import RankMarker
from common.ssh import SshError, SshTarget
from services.hostagent import client
from services.hostagent.client import Ladder, RemoteHost

MARKER = RankMarker(deployment_id="d", job_id="j", rank=1, pid=42, start_time=1.5,
                    host="b", phase="serving", updated_at=2.0)


def _host(monkeypatch, answer) -> RemoteHost:
    monkeypatch.setattr(client, "run_json", lambda target, argv, **kw: answer(argv))
    return RemoteHost(name="b", target=SshTarget("user@b"), python="python3", home="/h")


def test_a_probe_is_read_once_into_states_and_markers(monkeypatch) -> None:
    host = _host(monkeypatch, lambda argv: {
        "processes": [{"pid": 42, "state": "alive", "current": None}],
        "markers": [{"path": "/h/m/1.json", "marker": MARKER.to_dict()},
                    {"path": "/h/m/x.json", "marker": {"not": "a marker"}}],
        "unreadable": []})
    found = client.probe(host, [ProcessIdentity(42, 1.5, ("r",))], "d")
    assert found.states() == {42: ProcState.ALIVE}
    assert [m.pid for m in found.rank_markers("b")] == [42]  # the bad record is skipped


@pytest.mark.parametrize("answer,detail", [
    ({"processes": [{"pid": 42, "state": "dancing", "current": None}]},
     "wrong_type: processes[].state: expected a ProcState"),
    ({"processes": [{"pid": 42}]}, "missing_field: processes[].state"),
    ([], "wrong_type: body: expected map"),
])
def test_a_malformed_probe_is_an_ssh_error_naming_the_field(monkeypatch, answer, detail) -> None:
    host = _host(monkeypatch, lambda argv: answer)
    with pytest.raises(SshError) as exc:
        client.probe(host, [])
    assert exc.value.target == "user@b" and exc.value.what == f"probe answered badly: {detail}"


def test_a_malformed_wait_exit_ends_the_ladder_with_the_reason(monkeypatch) -> None:
    host = _host(monkeypatch, lambda argv: {"survivors": [{"pid": "x"}]})
    lad = Ladder(left=[ProcessIdentity(42, 1.5, ("r",))])
    client.wait_gone(host, lad, 0.1)
    assert "wait-exit answered badly: wrong_type: survivors[].pid" in lad.error
