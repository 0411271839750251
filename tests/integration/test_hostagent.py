"""services.hostagent on this host, run as the subprocess it is over ssh (through
common.ssh with a local target): every command, and its refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common import procs
from common.home import Paths, write_marker
from common.records import Phase, RankMarker
from common.ssh import SshError
from services.hostagent import agent_argv, parse_signal
from services.hostagent.base import AgentError
from services.hostagent.proc_cmds import spawn_outcome
from tests.support.hostagent import agent, ident_of
from tests.support.hostagent import spawn as agent_spawn
from tests.support.polling import poll_for

ROOT = Path(__file__).resolve().parents[2]
# A child that starts a grandchild in its own group, then ignores SIGTERM (after the
# start: an ignored signal stays ignored across exec); both sleep.
TREE = ("import signal, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(p.pid, flush=True); time.sleep(600)")


@pytest.fixture
def spawned():
    """spawn(argv, env=None) through the agent; every child is SIGKILLed at the end."""
    infos: list[dict] = []

    def spawn(argv: list[str], env: dict | None = None, **kw) -> dict:
        info = agent_spawn(argv, env=env, **kw)
        infos.append(info)
        return info

    yield spawn
    for info in infos:
        agent("signal-group", str(info["pgid"]), "KILL", "--members-json",
              json.dumps([ident_of(info)]))
        agent("signal", str(info["pid"]), repr(info["start_time"]), "KILL",
              "--cmdline-json", json.dumps(info["cmdline"]))
        assert agent("wait-exit", "--identities-json", json.dumps([ident_of(info)]),
                     "--timeout", "10") == {"survivors": []}


def test_spawn_detaches_takes_env_from_stdin_and_identify_sees_it(spawned, tmp_path):
    argv = [sys.executable, "-c", "import os, time; print(os.environ['X_SECRET'], "
            "os.environ.get('HOME'), flush=True); time.sleep(600)"]
    t0 = time.monotonic()
    info = spawned(argv, env={"X_SECRET": "hush", "HOME": None}, log=tmp_path / "logs/child.log")
    assert time.monotonic() - t0 < 10  # the agent returned while the child runs on
    pid = info["pid"]
    assert info["cmdline"] == argv and info["pgid"] == pid == os.getsid(pid)
    assert b"X_SECRET=hush" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"hush" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert (tmp_path / "logs").stat().st_mode & 0o777 == 0o700
    log = tmp_path / "logs/child.log"
    deadline = time.monotonic() + 20
    while b"hush" not in log.read_bytes():
        assert time.monotonic() < deadline, "the child never wrote its log"
        time.sleep(0.02)
    assert log.read_text().split() == ["hush", "None"]  # null removed HOME
    assert log.stat().st_mode & 0o777 == 0o600
    assert agent("identify", str(pid)) == ident_of(info)


def test_env_replace_gives_exactly_the_object(spawned, tmp_path):
    argv = ["/usr/bin/env"]
    # /usr/bin/env finishes at once with status 0: reported as already exited, or (on a
    # loaded host, if it had not finished within the agent's grace) as started.
    info = spawned(argv, env={"ONLY": "this"}, log=tmp_path / "env.log", extra=["--env-replace"])
    assert info["cmdline"] == argv and info.get("exited", 0) == 0
    assert agent("wait-exit", "--identities-json", json.dumps([ident_of(info)]),
                 "--timeout", "10") == {"survivors": []}
    assert (tmp_path / "env.log").read_text() == "ONLY=this\n"


def _exited_child(argv: list[str], log: Path) -> tuple[subprocess.Popen[bytes], float]:
    """A child of ours that has already exited, not reaped (a zombie), and its start time
    as read while it ran: the state the agent sees when a child is faster than it."""
    with log.open("ab") as out:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    start = procs.start_time_of(psutil.Process(child.pid))
    poll_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 20,
             f"{argv[0]} to exit")
    assert child.returncode is None  # not reaped yet
    return child, start


def test_a_child_that_exited_before_it_was_identified_is_a_spawn_with_its_status(tmp_path):
    log = tmp_path / "fast.log"
    child, start = _exited_child(["/bin/true"], log)
    assert spawn_outcome(child, ["/bin/true"], log) == {
        "pid": child.pid, "pgid": child.pid, "start_time": start, "cmdline": ["/bin/true"],
        "exited": 0}
    assert child.returncode == 0 and not psutil.pid_exists(child.pid)  # reaped: proven
    # a command that fails at once is an error naming its status and its log
    child, _ = _exited_child(["/bin/false"], log)
    with pytest.raises(AgentError) as err:
        spawn_outcome(child, ["/bin/false"], log)
    assert f"exited at once with status 1; see {log}" in str(err.value)
    assert child.returncode == 1


def test_signal_needs_the_exact_identity(spawned, tmp_path):
    info = spawned([sys.executable, "-c", "import time; time.sleep(600)"], log=tmp_path / "l")
    pid, start, cmd = str(info["pid"]), info["start_time"], json.dumps(info["cmdline"])
    assert agent("signal", pid, repr(start + 1), "KILL", "--cmdline-json", cmd) == {"sent": False}
    assert agent("signal", pid, repr(start), "KILL", "--cmdline-json", '["other"]') == {
        "sent": False}
    assert agent("identify", pid) is not None
    assert agent("signal", pid, repr(start), "SIGTERM", "--cmdline-json", cmd) == {"sent": True}
    assert agent("wait-exit", "--identities-json", json.dumps([ident_of(info)]),
                 "--timeout", "10") == {"survivors": []}
    assert agent("identify", pid) is None
    # Gone (or a zombie): never signalled again.
    assert agent("signal", pid, repr(start), "KILL", "--cmdline-json", cmd) == {"sent": False}


def test_signal_group_reaches_the_tree_only_with_a_live_member(spawned, tmp_path):
    log = tmp_path / "tree.log"
    info = spawned([sys.executable, "-c", TREE], log=log)
    deadline = time.monotonic() + 20
    while not log.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = agent("identify", log.read_text().split()[0])
    assert grandchild is not None
    stranger = {**ident_of(info), "start_time": info["start_time"] - 7}
    assert agent("signal-group", str(info["pgid"]), "KILL", "--members-json",
                 json.dumps([stranger])) == {"sent": False}
    assert agent("signal-group", str(info["pgid"]), "TERM", "--members-json",
                 json.dumps([ident_of(info)])) == {"sent": True}
    # The child ignores SIGTERM; its grandchild does not.
    left = agent("wait-exit", "--identities-json", json.dumps([ident_of(info), grandchild]),
                 "--timeout", "1")
    assert left == {"survivors": [ident_of(info)]}
    assert agent("signal-group", str(info["pgid"]), "9", "--members-json",
                 json.dumps([ident_of(info)])) == {"sent": True}
    assert agent("wait-exit", "--identities-json", json.dumps([ident_of(info)]),
                 "--timeout", "10") == {"survivors": []}


def test_write_file_is_atomic_and_exactly_the_mode(tmp_path):
    path = tmp_path / "a" / "b" / "secret.key"
    with pytest.raises(SshError):  # no --parents: the directory must exist
        agent("write-file", str(path), input=b"x")
    answer = agent("write-file", str(path), "--parents", input=b"\x00\xffbytes")
    assert answer == {"path": str(path), "bytes": 7, "mode": "600"}
    assert path.read_bytes() == b"\x00\xffbytes" and path.stat().st_mode & 0o777 == 0o600
    assert agent("write-file", str(path), "--mode", "640", input=b"new")["mode"] == "640"
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret.key"]
    with pytest.raises(SshError):
        agent("write-file", str(path), "--mode", "9", input=b"x")


def test_read_markers_reports_markers_and_unreadable_files(tmp_path):
    paths = Paths(home=tmp_path / "home").ensure()
    write_marker(paths, RankMarker(deployment_id="d1", job_id="j1", rank=0, host="h", pid=4242,
                                   start_time=1.5, phase=Phase.SERVING, updated_at=2.0))
    (paths.markers / "d1" / "rank-1.json").write_text("{broken")
    (paths.markers / "d1" / "notes.txt").write_text("not a marker")
    scan = agent("read-markers", "--home", str(paths.home))
    assert [(m["marker"]["rank"], m["marker"]["pid"], m["marker"]["phase"])
            for m in scan["markers"]] == [(0, 4242, "serving")]
    assert [Path(u["path"]).name for u in scan["unreadable"]] == ["rank-1.json"]
    assert agent("read-markers", "--home", str(paths.home), "--deployment", "d2") == {
        "markers": [], "unreadable": []}
    with pytest.raises(SshError):
        agent("read-markers", "--home", str(paths.home), "--deployment", "../etc")


def test_bad_input_is_an_error_answer_not_a_traceback():
    with pytest.raises(SshError) as err:
        agent("wait-exit", "--identities-json", "[{\"pid\": 0}]", "--timeout", "1")
    assert "pid" in str(err.value)
    with pytest.raises(SshError) as err:
        agent("signal", "1", "1.0", "NOTASIGNAL", "--cmdline-json", "[]")
    assert "unknown signal" in str(err.value)
    cp = subprocess.run(agent_argv(sys.executable, "identify"), capture_output=True, cwd=ROOT)
    assert cp.returncode == 2  # usage error from argparse
    assert agent("identify", "999999999") is None


@pytest.mark.parametrize("text,num", [("TERM", signal.SIGTERM), ("sigkill", signal.SIGKILL),
                                      ("SIGINT", signal.SIGINT), ("15", 15)])
def test_parse_signal(text, num):
    assert parse_signal(text) == num
