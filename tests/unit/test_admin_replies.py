"""Admin replies are typed (common/messages/commands): what the supervisor's producers
write decodes into each command's Reply, a malformed reply is a ReplyError naming the
command and the field (never a KeyError), each Reply renders the CLI's text, and the
CLI's flags come from the Args."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from common.messages.commands import (
    COMMANDS,
    ReplyError,
    args_wire,
    cancel,
    command_of,
    deploy,
    stop,
)
from common.messages.vocab import Backend, CancelScope, DeploymentState
from services.admin.cli import _parser, build_request, human
from services.reaper.reap import ReapReport
from services.supervisor.plan import selection_for
from services.supervisor.teardown import TeardownOutcome


def test_every_command_has_args_a_reply_that_renders_and_a_summary() -> None:
    for cmd in COMMANDS.values():
        assert callable(cmd.reply.render), cmd.name
        assert cmd.summary and cmd.wait_s > 0 and command_of(cmd.args.__new__(cmd.args)) is cmd


def test_what_the_producers_write_decodes() -> None:
    reap = COMMANDS["reap"].decode(ReapReport(reaped=["j-1"], failures=[
        {"job_id": "j-2", "reason": "survived", "survivors": [{"pid": 4}]}]).to_dict())
    assert reap.blocking and reap.failures[0].job_id == "j-2"
    assert reap.render() == "reaped ['j-1']; active none\n  FAILED j-2: survived"
    out = TeardownOutcome(path=["shutdown", "sigterm"], duration_s=0.5)
    st = COMMANDS["stop"].decode({"deployment_id": "d", "outcome": out.to_wire()})
    assert st.outcome.proven and st.render() == (
        "stopped d: shutdown -> sigterm in 0.50s, every rank's exit proven")
    assert COMMANDS["stop"].decode({"deployment_id": "d", "outcome": {}}).outcome.path == []
    sel = COMMANDS["backend_selection"].decode(selection_for(None, "auto").to_wire())
    assert sel.backend is Backend.NONE and sel.render().startswith("backend none (1 members)")


@pytest.mark.parametrize("command,data,detail", [
    ("ping", {"pid": 1, "boot_id": "b"}, "missing_field: version"),
    ("deploy", {"deployment_id": "d", "job_id": "j", "state": "dancing"},
     "wrong_type: state: expected a DeploymentState"),
    ("cancel", {"epoch": "7", "acked": {}, "missing": [], "dead": [], "sends": 1},
     "wrong_type: epoch: expected int"),
    ("deployments", {"deployments": [{"deployment_id": "d"}]},
     "missing_field: deployments[].job_id"),
    ("status", [], "wrong_type: body: expected map"),
    ("abort_all", {"epoch": 1, "zero_active": True, "surprise": 1}, "extra_field: surprise"),
])
def test_a_malformed_reply_is_a_clear_error(command, data, detail) -> None:
    with pytest.raises(ReplyError) as exc:
        human(command, data)
    assert str(exc.value) == f"the supervisor's {command} reply: {detail}"
    assert exc.value.command == command


def test_replies_render_as_the_cli_printed_them() -> None:
    d = COMMANDS["deploy"].decode({"deployment_id": "d", "job_id": "j", "state": "serving"})
    assert d.state is DeploymentState.SERVING and d.render() == "d: serving (job j)"
    assert human("cancel", {"epoch": 3, "acked": {"1": {}, "0": {}}, "missing": [],
                            "dead": [], "sends": 2}) == (
        "epoch 3: acked by ranks ['0', '1']; missing []; dead [] (2 sends)")
    assert human("cache_clear", {"deployment_id": "d", "clear_id": 1, "step": 9,
                                 "enabled": False, "sends": 1, "waited_s": 0.1}) == (
        "d: the prefix cache is off, nothing to clear")
    assert human("replan", {"preview": True, "plan": {"b": 1}, "current": {"a": 2},
                            "signature": "s"}) == (
        'preview: {"a": 2} -> {"b": 1}\napply with: --signature s')
    assert human("ping", {"pid": 7, "boot_id": "b", "version": "0.1"}) == (
        "supervisor pid 7 (boot b, version 0.1)")
    assert human("deployments", {"deployments": []}) == "no deployments"


def test_the_cli_flags_are_the_args_fields() -> None:
    p = _parser()
    cmd, args = build_request(p.parse_args(["cancel", "d", "--scope", "all", "--request-id",
                                            "a", "--request-id", "b", "--reason", "why"]))
    assert cmd.name == "cancel" and args == cancel.Args("d", CancelScope.ALL, ["a", "b"], "why")
    cmd, args = build_request(p.parse_args(["deploy", "--model", "/m", "--tp", "2", "--id",
                                            "x", "--no-wait", "--top-k", "5"]))
    assert args_wire(args)["sampling"]["top_k"] == 5 and not args.wait
    assert (args.model_path, args.tp, args.deployment_id) == ("/m", 2, "x")
    assert deploy.Args().wait  # only what is given is set
    cmd, args = build_request(p.parse_args(["stop", "d", "--force"]))
    assert args == stop.Args("d", True)
    cmd, args = build_request(p.parse_args(["abort-all"]))
    assert cmd.name == "abort_all" and args.deployment_id is None
    with pytest.raises(SystemExit):
        p.parse_args(["replan", "d"])  # --backend is required there


async def test_the_gateway_keeps_the_status_it_decoded_once(tmp_path) -> None:
    from common.messages import AdminCode, AdminReply, Event, EventName, EventTopic
    from common.schema import to_wire
    from services.gateway.core.cluster_view import Cluster, SupervisorUnavailable
    from services.gateway.core.settings import GatewaySettings
    from tests.support.bus import KEY
    from tests.support.deployment import deployment_info

    eps = {"admin": "a", "events": "e", "control": "c", "report": "r"}
    status = {"supervisor": {"pid": 1, "boot_id": "b", "uptime_s": 1.0, "home": "/h",
                             "endpoints": eps}, "cancel_epoch": 3,
              "deployments": [to_wire(deployment_info(deployment_id="d-1"))]}
    answer = {"data": status}

    async def admin(command, args=None, timeout=None):
        return AdminReply("r", True, AdminCode.OK, data=answer["data"])

    c = Cluster(GatewaySettings(home=tmp_path), KEY)
    c.admin = admin
    try:
        await c.refresh()
        assert c.deployments["d-1"].state is DeploymentState.SERVING and c.status.cancel_epoch == 3
        assert [d.deployment_id for d in c.serving()] == ["d-1"]
        c._apply_state_event(Event(topic=EventTopic.DEPLOYMENT, name=EventName.STATE,
                                   deployment_id="d-1", state=DeploymentState.FAILED,
                                   reason="rank 1 lost", data={"job_id": "j-1"}))
        assert c.deployments["d-1"].state is DeploymentState.FAILED and not c.serving()
        answer["data"] = {**status, "cancel_epoch": "3"}
        with pytest.raises(SupervisorUnavailable, match="status reply: wrong_type: cancel_epoch"):
            await c.refresh()
    finally:
        c.ctx.destroy(linger=0)


async def test_the_supervisors_commands_answer_what_their_replies_declare(tmp_path) -> None:
    """The real command modules through the real dispatcher, on a fake CommandHost: each
    reply passes the dispatcher's own check and decodes on the client's side."""
    import time
    from types import SimpleNamespace

    from common.envelope import Key
    from common.home import Paths, write_adoption_record
    from common.messages import AdminCode, AdminRequest, Phase
    from common.procs import identify
    from common.records import AdoptionRecord
    from services.reaper.reap import ReapReport
    from services.supervisor import commands as sup_commands
    from services.supervisor.deployment import Deployment, RankState
    from services.supervisor.plan import DeployPlan

    plan = DeployPlan(model_path="/models/tiny", tp=2, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    dep = Deployment(deployment_id="d-1", job_id="j-1", plan=plan, initial="serving",
                     ranks={r: RankState(rank=r, host="h", phase=Phase.SERVING) for r in (0, 1)})
    paths = Paths(tmp_path)
    paths.runtime.mkdir(parents=True)
    me = identify(os.getpid())  # a live `up` restarts this supervisor: status says how
    write_adoption_record(paths.adoption_file, AdoptionRecord(
        up_pid=me.pid, up_start_time=me.start_time, window_s=30.0, supervisor_restarts=3,
        restart_window_s=600.0, restarts=1))
    eps = SimpleNamespace(admin_endpoint="tcp://a", events_endpoint="tcp://e",
                          control_endpoint="tcp://c", report_endpoint="tcp://r")
    sup = SimpleNamespace(me=SimpleNamespace(pid=7), version="0.1", started_at=time.time(),
                          paths=paths, sockets=eps,
                          deployments={"d-1": dep}, cluster_key=Key.from_secret(b"c" * 32),
                          epochs=SimpleNamespace(current=3), journal=[],
                          last_reap=ReapReport(reaped=["j-0"]).to_dict(),
                          adoption_rejections=Counter(not_proven=1))
    for name in ("ping", "status", "deployments"):
        reply = await sup_commands.dispatch(sup, AdminRequest("r", name, {}))
        assert reply.ok, (name, reply.message)
        assert COMMANDS[name].decode(reply.data).render()
    status = COMMANDS["status"].decode(
        (await sup_commands.dispatch(sup, AdminRequest("r", "status", {}))).data)
    assert status.reaper.reaped == ["j-0"] and status.deployments[0].ranks[1].rank == 1
    assert status.supervisor.restarts.supervisor_restarts == 3
    assert "at most 3 within 600s (1 so far), ranks wait 30s" in status.render()
    bad = await sup_commands.dispatch(sup, AdminRequest("r", "stop", {"force": True}))
    assert not bad.ok and bad.code is AdminCode.BAD_REQUEST
    assert bad.data["field"] == "args.deployment_id"
