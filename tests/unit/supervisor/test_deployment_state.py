"""The deployment state table: every wire string, every allowed edge, and a refused one."""

from __future__ import annotations

import pytest

from services.supervisor.deployment import LIVE, Deployment
from services.supervisor.deployment_state import ALLOWED, Claim, IllegalTransition, StateMachine
from services.supervisor.deployment_state import DeploymentState as S
from services.supervisor.plan import DeployPlan

WIRE = {"launching", "loading", "canary", "serving", "stopping", "stopped", "failed",
        "teardown_failed", "adopting"}
EDGES = {
    ("launching", "loading"), ("loading", "canary"), ("canary", "serving"),
    ("launching", "failed"), ("loading", "failed"), ("canary", "failed"),
    ("launching", "teardown_failed"), ("loading", "teardown_failed"),
    ("canary", "teardown_failed"), ("serving", "failed"), ("failed", "teardown_failed"),
    ("serving", "stopping"), ("failed", "stopping"), ("teardown_failed", "stopping"),
    ("stopping", "stopped"), ("stopping", "teardown_failed"), ("failed", "stopped"),
    ("adopting", "serving"), ("adopting", "failed"), ("adopting", "teardown_failed"),
}


def test_the_states_are_the_wire_strings() -> None:
    assert {s.value for s in S} == WIRE == {s.value for s in ALLOWED}
    assert {s.value for s in LIVE} == {"launching", "loading", "canary", "serving", "stopping",
                                      "adopting"}
    assert S("serving") is S.SERVING and str(S.TEARDOWN_FAILED) == "teardown_failed"


def test_the_table_is_exactly_the_edges_the_supervisor_takes() -> None:
    assert {(a.value, b.value) for a, tos in ALLOWED.items() for b in tos} == EDGES
    assert not ALLOWED[S.STOPPED]  # terminal


@pytest.mark.parametrize(("frm", "to"), sorted(EDGES))
def test_an_allowed_edge_moves_and_is_recorded(frm: str, to: str) -> None:
    m = StateMachine("d", S(frm))
    assert m.transition(S(to), "why")
    assert m.state is S(to)
    (t,) = m.history
    assert (t.frm, t.to, t.reason) == (S(frm), S(to), "why") and t.at > 0


@pytest.mark.parametrize(("frm", "to"), sorted(
    (a.value, b.value) for a in S for b in S if a != b and (a.value, b.value) not in EDGES))
def test_any_other_edge_raises_and_changes_nothing(frm: str, to: str) -> None:
    m = StateMachine("d", S(frm))
    with pytest.raises(IllegalTransition) as info:
        m.transition(S(to))
    assert (info.value.frm, info.value.to) == (S(frm), S(to))
    assert m.state is S(frm) and not m.history


def test_the_same_state_is_no_transition() -> None:
    m = StateMachine("d")
    assert not m.transition(S.LAUNCHING) and not m.history


def test_a_deployment_is_launching_and_its_wire_state_is_a_plain_string() -> None:
    plan = DeployPlan(model_path="/m/tiny", tp=1, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    dep = Deployment("d", "j", plan)
    assert dep.state is S.LAUNCHING
    dep.life.transition(S.LOADING)
    wire = dep.to_wire(with_key=False)["state"]
    assert wire == "loading" and type(wire) is str


def test_one_claim_at_a_time() -> None:
    m = StateMachine("d")
    assert not m.busy and m.claim(Claim.LAUNCH) and m.busy
    assert not m.claim(Claim.STOP) and m.holder is Claim.LAUNCH  # the stop is refused
    m.release()
    assert not m.busy and m.claim(Claim.AFTER_FAILURE) and m.holder is Claim.AFTER_FAILURE
