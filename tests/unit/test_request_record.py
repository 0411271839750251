"""Rank 0's request record (services/rank/request_record.py): every transition the table
allows is taken through the record's methods, every other one raises; the leader's
inbox dispatch is a table keyed on message kind."""

from __future__ import annotations

import itertools

import pytest

from common.messages import FinishReason, PlanInsert, RemoveReason, SeededSampling
from services.rank import events as ev
from services.rank.request_record import (
    TRANSITIONS,
    IllegalTransition,
    RequestRecord,
    Status,
)


def record(status: Status = Status.WAITING) -> RequestRecord:
    rec = RequestRecord(PlanInsert("r", [1, 2, 3], 4, SeededSampling(seed=1)), received_at=10.0)
    rec.status = status  # the starting point of one case
    return rec


# The method that makes each change, with its arguments.
MOVES = {
    Status.PREFILLING: lambda r: r.planned(),
    Status.DECODING: lambda r: r.first_token(10.25),
    Status.REMOVING: lambda r: r.removing(RemoveReason.ABORT),
    Status.PREEMPTED: lambda r: r.preempted(),
    Status.WAITING: lambda r: r.requeued(),
    Status.FINISHED: lambda r: r.finished(FinishReason.STOP),
}


@pytest.mark.parametrize(("start", "end"), list(itertools.product(Status, Status)),
                         ids=lambda s: str(s))
def test_each_transition_is_allowed_exactly_as_the_table_says(start, end):
    rec = record(start)
    if end in TRANSITIONS[start]:
        MOVES[end](rec)
        assert rec.status is end
    elif start is end is Status.REMOVING:
        assert rec.removing(RemoveReason.CANCEL) is False  # already being removed
    else:
        with pytest.raises(IllegalTransition, match=f"r: {start} -> {end}"):
            MOVES[end](rec)
        assert rec.status is start


def test_a_request_s_life_and_what_each_step_records():
    rec = record()
    rec.planned()
    assert rec.first_token(10.25) == pytest.approx(250.0)  # its TTFT, in ms
    assert rec.removing(RemoveReason.ABORT) is True
    assert rec.removing(RemoveReason.CANCEL) is False and rec.remove_reason is RemoveReason.ABORT
    rec.finished(FinishReason.ABORT)
    assert (rec.status, rec.finish_reason) == (Status.FINISHED, FinishReason.ABORT)
    assert not TRANSITIONS[Status.FINISHED]  # the end: nothing follows


def test_every_status_is_reachable_from_waiting_and_leads_to_finished():
    seen, todo = {Status.WAITING}, [Status.WAITING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(Status)
    assert all(Status.FINISHED in TRANSITIONS[s] for s in Status if s is not Status.FINISHED)


def test_the_leader_dispatches_by_message_kind():
    from services.rank.follower import Follower
    from services.rank.leader import Leader
    from services.rank.loop import RankLoop

    common = {ev.CancelEv, ev.ShutdownEv, ev.SignalEv, ev.ExitEv, ev.IoFailed}
    leader = {ev.GenerateEv, ev.AbortEv, ev.AbortAllEv, ev.CacheClearEv, ev.DiskIndexEv}

    def kinds(cls) -> set[type]:
        return set(cls.__new__(cls).handlers())  # needs no state: every entry binds late

    assert kinds(RankLoop) == common
    assert kinds(Leader) == common | leader
    assert kinds(Follower) == common | {ev.PlanEv, ev.PlanMissingEv}


def test_the_io_thread_carries_out_every_outbox_command_by_kind():
    import typing

    from services.rank import outbox
    from services.rank.io import RankIO

    table = RankIO.__new__(RankIO)._command_handlers()  # bound late: needs no state
    assert set(table) == set(typing.get_args(outbox.Command))
    assert len({h.__func__ for h in table.values()}) == len(table)  # one handler each
