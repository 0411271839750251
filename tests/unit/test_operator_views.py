"""The operator's text views, pure: `lockstep admin status|watch` rendering
(`status.Reply.render`, common/messages/commands/status_text.py) from a real Deployment's wire form and a journal of events,
`lockstep up`'s stage lines (services/up/progress.py), and a rank's load meter
(services/rank/load_progress.py)."""

from __future__ import annotations

from common.deployment_info import read_deployment_info
from common.messages import (
    CacheStats,
    DeploymentState,
    Event,
    EventName,
    EventTopic,
    KvStats,
    LoadProgress,
    Phase,
    ReapOutcome,
)
from common.messages.commands import COMMANDS
from common.schema import to_wire
from services.admin.cli import human
from services.rank.load_progress import LoadMeter
from services.supervisor.deployment import Deployment, RankState
from services.supervisor.plan import DeployPlan
from services.up.progress import ERASE, UpProgress, stage_line

NOW = 1_000_000.0


def _dep(state: str = "serving", dep_id: str = "dep-1", **rank1) -> dict:
    plan = DeployPlan(model_path="/models/tiny", tp=2, pp=1, backend="ring",
                      requested_backend="auto", hosts=None, members=[])
    dep = Deployment(deployment_id=dep_id, job_id="job-1", plan=plan, initial=state,
                     requests_endpoint="tcp://127.0.0.1:6000",
                     ranks={0: RankState(rank=0, host="mac-a", phase=Phase.SERVING, step=100,
                                         active=3, mem_active=512 * 2**20, last_seen=NOW - 0.5,
                                         cancel_epoch=4, acked_epoch=4,
                                         cache=CacheStats(entries=2, tokens=90, bytes=2**20,
                                                          hits=3, misses=1, hit_tokens=60),
                                         kv=KvStats(budget=8 * 2**20, slot_bytes=1024,
                                                    held=2**20, held_peak=3 * 2**20,
                                                    reserved=6 * 2**20, waiting=1, waits=5,
                                                    refused=2,
                                                    queued_by_priority={"10": 3, "-5": 1},
                                                    queued_by_tenant={"alice": 3, "bob": 1})),
                            1: RankState(rank=1, host="mac-b", step=100, last_seen=NOW - 0.4,
                                         **{"phase": Phase.SERVING, **rank1})})
    return dep.to_wire()


def _ev(topic: str, name: str, dep: str, state: str, reason: str, at: float, **data) -> dict:
    """A journal entry; for topic reap, `state` is the reap's outcome."""
    reap = topic == EventTopic.REAP
    return to_wire(Event(topic=EventTopic(topic), name=EventName(name), deployment_id=dep,
                         state=None if reap else DeploymentState(state), reason=reason,
                         at=at, data=data, outcome=ReapOutcome(state) if reap else None))


JOURNAL = [
    _ev("deployment", "state", "old", "loading", "2 rank(s) started", NOW - 100),
    _ev("deployment", "state", "old", "serving", "canary passed", NOW - 90),
    _ev("incident", "rank_lost", "old", "serving", "rank 1 (pid 42) exited with code -9", NOW - 60),
    _ev("deployment", "state", "old", "failed", "rank 1 (pid 42) exited with code -9", NOW - 60),
    _ev("deployment", "teardown", "old", "failed", "teardown after the failure proven", NOW - 59,
        outcome={"path": ["shutdown", "sigterm"], "proven": True}),
    _ev("deployment", "state", "dep-1", "loading", "2 rank(s) started", NOW - 50),
    _ev("reap", "pass", "", "ok", "nothing to reap", NOW - 49, reaped=[]),
    _ev("deployment", "state", "dep-1", "serving", "canary passed", NOW - 30),
]


def _status(*deps: dict, events=JOURNAL) -> dict:
    eps = {"admin": "tcp://a", "events": "tcp://e", "control": "tcp://c", "report": "tcp://r"}
    return {"supervisor": {"pid": 7, "boot_id": "b", "uptime_s": 125.0, "home": "/h",
                           "endpoints": eps}, "cancel_epoch": 4,
            "deployments": list(deps), "events": list(events), "reaper": None,
            "rejections": [{"service": "rank", "socket": "control", "reason": "mac", "count": 2}]}


def _render(data: dict, **kw) -> str:
    return COMMANDS["status"].decode(data).render(**kw)


def test_status_shows_hosts_memory_cache_and_the_last_incidents() -> None:
    out = _render(_status(_dep()), now=NOW)
    lines = out.splitlines()
    assert lines[0] == "supervisor pid 7 up 2m05s home /h cancel epoch 4"
    assert lines[1].startswith("dep-1  serving up 30.0s  tiny tp=2 pp=1 backend=ring")
    assert "prefix cache 2 entries, 90 tokens, 1.0 MiB; hits 3/4 (75%), 60 prompt tokens" in out
    rank0 = next(ln for ln in lines if ln.split()[:2] == ["0", "mac-a"])
    assert "512.0 MiB" in rank0 and " 3 " in rank0 and rank0.rstrip().endswith("4/4")
    assert "rejected rank/control mac: 2" in out
    assert ("KV budget: 8.0 MiB per rank; held rank 0 1.0 MiB (peak 3.0 MiB); reserved 6.0 MiB;"
            " queue head waits for room (5 waits), 0 preempted, 2 refused as too large") in out
    assert "rank 0's queue: priority -5: 1, priority 10: 3; by key alice: 3, bob: 1" in out
    inc = lines[lines.index("last incidents (newest first):") + 1:]
    kinds = [ln.split()[1] for ln in inc]
    # newest first; a deploy after a loss is a redeploy; an empty reap pass is no incident
    assert kinds == ["serving", "redeploy", "teardown", "failed", "rank_lost", "serving", "deploy"]
    assert "[teardown shutdown -> sigterm (proven)]" in inc[2]
    assert human("status", _status(_dep())).startswith("supervisor pid 7")


def test_watch_rates_steps_between_two_replies_and_shows_load() -> None:
    first = _status(_dep())
    assert " - " in _render(first, now=NOW)  # one reply: no rate yet
    later = _dep()
    for r in later["ranks"]:
        r["step"] += 30
        r["last_seen"] += 2.0
    out = _render(_status(later), now=NOW + 2,
                  prev=COMMANDS["status"].decode(first).steps())
    rank0 = next(ln for ln in out.splitlines() if ln.split()[:2] == ["0", "mac-a"])
    assert rank0.split()[5] == "15.0", rank0  # 30 steps in 2 s
    loading = _dep("loading", phase=Phase.LOADING,
                   load=LoadProgress(read_bytes=3 * 2**20, total_bytes=12 * 2**20))
    out = _render(_status(loading, events=[]), now=NOW)
    assert "load 25% of 12.0 MiB" in out and "last incidents" not in out


class FakeConsole:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.logged: list[str] = []

    def say(self, text: str) -> None:
        self.out.append(text + "\n")
        self.logged.append(text)

    def redraw(self, text: str) -> None:
        self.out.append(text)

    def log_only(self, text: str) -> None:
        self.logged.append(text)


def _loading(read: int) -> object:
    d = _dep("loading", phase=Phase.LOADING, load=LoadProgress(read_bytes=read, total_bytes=100 * 2**20))
    d["ranks"][0]["phase"] = "starting"
    return read_deployment_info(d)


def test_up_progress_one_live_line_per_stage_on_a_tty() -> None:
    c = FakeConsole()
    p = UpProgress(c, tty=True)
    for read in (10 * 2**20, 10 * 2**20, 60 * 2**20):
        p.update(_loading(read))
    p.update(read_deployment_info(_dep("canary")))
    p.end()
    text = "".join(c.out)
    assert text.count(ERASE) == 3  # two redraws of the loading line, one canary line
    assert "rank 1 60% (60.0 MiB/100.0 MiB)" in text and "rank 0 starting" in text
    assert text.count("\n") == 2  # each stage's line ends once
    assert c.logged == ["lockstep up: loading weights: rank 0 starting, rank 1 60% "
                        "(60.0 MiB/100.0 MiB)",
                        "lockstep up: canary: greedy generations compared across runs"]


def test_up_progress_plain_lines_in_quarters_without_a_tty() -> None:
    c = FakeConsole()
    p = UpProgress(c, tty=False)
    for mib in (1, 5, 20, 26, 30, 55, 99):
        p.update(_loading(mib * 2**20))
    assert [ln.strip() for ln in c.out] == [
        f"lockstep up: loading weights: rank 0 starting, rank 1 {q}%" for q in (0, 25, 50, 75)]
    assert ERASE not in "".join(c.out)
    assert stage_line(read_deployment_info(_dep("launching")), coarse=True) == (
        "launching", "launching 2 rank(s) (backend ring)")


def test_load_meter_counts_reads_from_the_last_sample_before_loading(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"y" * 50)  # not weights
    reads = iter([5000, 7000, 7400, 8500, 9000])
    m = LoadMeter(read=lambda: next(reads))
    assert m.sample(Phase.STARTING, str(tmp_path)) is None
    assert m.sample(Phase.STARTING, str(tmp_path)) is None  # the baseline: 7000
    assert m.sample(Phase.LOADING, str(tmp_path)) == LoadProgress(400, 1000)
    assert m.sample(Phase.LOADING, str(tmp_path)) == LoadProgress(1000, 1000)  # capped
    assert m.sample(Phase.SERVING, str(tmp_path)) is None
