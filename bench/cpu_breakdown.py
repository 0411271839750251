"""CPU per generated token, per process and per OS thread, measured from outside.

`snapshot(find)` reads, with psutil, the user/system CPU seconds of every process `find()`
names (role -> pid) and of each of its OS threads, plus the machine's busy CPU seconds;
`breakdown(before, after, tokens)` divides the differences by the completion tokens the
measurement generated. Nothing is estimated: a process that exited or was replaced between
the two snapshots is recorded as null with the reason, never interpolated.

Roles of a `lockstep up` deployment come from each descendant's command line (`role_of`):
`up` (the `lockstep up` process itself), `supervisor`, `reaper`, `gateway`, `rank_N`
(`-m services.rank --spec .../rank-N.spec.json`); anything else is `other_<pid>`.

Threads: Python threads are not named at the OS level (their OS name is the process's,
`python`), so which thread is which is inferred from CPU share, not known. Per process:
- `busiest_thread`: the thread with the most CPU over the window. Measured on the tiny
  preset, for a rank and for mlx_lm.server this is usually NOT Python's step/generation
  loop but a thread Python did not start, most likely MLX's CPU stream worker, where the
  model's kernels run: the in-process baseline, which starts no threads of its own,
  shows the same heavy non-initial thread; at TP=2 it is the thread with the most
  system CPU, i.e. the distributed backend's communication.
- `python_main_thread`: the process's initial thread (tid == pid), which is where
  CPython's main thread runs — a fact, not an inference: a rank's step loop (plan, engine
  bookkeeping, graph building, sampling); for mlx_lm.server its HTTP server (generation
  is on a thread of its own).
- `other_threads`: every live thread but the busiest (the Python main thread included
  when it is not the busiest).
- `busiest`: the few busiest threads one by one, each with its OS name
  (/proc/<pid>/task/<tid>/comm, e.g. ZeroMQ's `ZMQbg/IO/0`) and `is_initial_thread`, the
  evidence for the inferences above.
- `ended_or_rounding`: the process total minus every live thread: CPU of threads that
  ended inside the window, plus the rounding between per-thread and per-process times (a
  tick or two either way, so it can be slightly negative).
Times come in clock ticks: `clock_tick_us_per_token` is the resolution of every number.
`machine_busy` is every CPU of the machine, other work on it included, and
`machine_busy_fraction` its share of window x cpus: on a shared machine it says how much
of the run others took.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_RANK_SPEC = re.compile(r"rank-(\d+)\.spec\.json$")
_CLI_ROLES = ("supervisor", "reaper", "gateway", "up")
TOP_THREADS = 3  # listed one by one; the rest only summed


@dataclass(frozen=True)
class ThreadTimes:
    tid: int
    name: str
    user: float
    system: float


@dataclass(frozen=True)
class ProcTimes:
    pid: int
    create_time: float
    user: float
    system: float
    threads: dict[int, ThreadTimes] | None  # None: the OS would not say (AccessDenied)


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    procs: dict[str, ProcTimes | str]  # a str says why the process could not be read
    machine_busy: float  # busy CPU seconds summed over every CPU of the machine


def role_of(cmdline: list[str]) -> str | None:
    """A deployment process's role from its command line; None if it is none of ours."""
    if "services.rank" in cmdline:
        for arg in cmdline:
            if m := _RANK_SPEC.search(arg):
                return f"rank_{m.group(1)}"
        return None
    for mod, sub in (("services", True), ("services.gateway", False),
                     ("services.supervisor", False), ("services.reaper", False)):
        if mod in cmdline:
            if not sub:
                return mod.split(".")[1]
            i = cmdline.index(mod)
            if i + 1 < len(cmdline) and cmdline[i + 1] in _CLI_ROLES:
                return cmdline[i + 1]
    return None


def tree_roles(root_pid: int, root_role: str | None = None) -> dict[str, int]:
    """role -> pid for `root_pid` and its descendants (roles by `role_of`); a process
    whose command line is none of ours is `other_<pid>`. `root_role` names the root when
    its command line would not (e.g. `mlx_lm_server`)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, int] = {}
    for p in procs:
        try:
            role = root_role if p.pid == root_pid and root_role else role_of(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = role or f"other_{p.pid}"
        out[f"{role}_{p.pid}" if role in out else role] = p.pid
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_times(pid: int) -> ProcTimes | str:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            ct, cpu = p.create_time(), p.cpu_times()
            try:
                threads = {t.id: ThreadTimes(t.id, _thread_name(pid, t.id), t.user_time,
                                             t.system_time) for t in p.threads()}
            except psutil.AccessDenied:
                threads = None
        return ProcTimes(pid, ct, cpu.user, cpu.system, threads)
    except psutil.NoSuchProcess:
        return f"pid {pid} no longer exists"
    except psutil.AccessDenied:
        return f"pid {pid}: access denied"


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def snapshot(find: Callable[[], dict[str, int]]) -> Snapshot:
    return Snapshot(time.monotonic(), {role: _proc_times(pid) for role, pid in find().items()},
                    _machine_busy())


def _us(seconds: float, tokens: int) -> float:
    return round(seconds / tokens * 1e6, 1)


def _threads(b: ProcTimes, a: ProcTimes, total: float, tokens: int) -> dict | None:
    if a.threads is None or b.threads is None:
        return None
    deltas = []
    for tid, t in a.threads.items():
        t0 = b.threads.get(tid)  # absent: started inside the window, from zero
        du, ds = t.user - (t0.user if t0 else 0.0), t.system - (t0.system if t0 else 0.0)
        deltas.append((du + ds, du, ds, t))
    if not deltas:
        return None
    deltas.sort(key=lambda d: (-d[0], d[3].tid))
    live = sum(d[0] for d in deltas)
    other_by_name: dict[str, float] = {}
    for d in deltas[1:]:
        other_by_name[d[3].name or "?"] = other_by_name.get(d[3].name or "?", 0.0) + d[0]
    return {
        "count_at_end": len(a.threads),
        "busiest_thread": _us(deltas[0][0], tokens),
        "python_main_thread": _us(sum(d[0] for d in deltas if d[3].tid == a.pid), tokens),
        "other_threads": _us(live - deltas[0][0], tokens),
        # Threads that ended inside the window, plus per-thread vs per-process tick
        # rounding (so within a tick or two of 0 it is rounding, and may be negative).
        "ended_or_rounding": _us(total - live, tokens),
        "busiest": [{"tid": t.tid, "os_name": t.name, "is_initial_thread": t.tid == a.pid,
                     "user": _us(du, tokens), "system": _us(ds, tokens),
                     "total": _us(tot, tokens)} for tot, du, ds, t in deltas[:TOP_THREADS]],
        "other_by_os_name": {k: _us(v, tokens) for k, v in
                             sorted(other_by_name.items(), key=lambda kv: -kv[1]) if v > 0},
    }


def breakdown(before: Snapshot, after: Snapshot, tokens: int,
              outside: tuple[str, ...] = ("bench_client",)) -> dict:
    """µs of CPU per completion token, per role; `deployment_total` sums every role but
    `outside` (null if any of those is null); `machine_busy` is the whole machine's (other
    work on it included), comparable with `window_s` x cpus."""
    procs: dict[str, dict | None] = {}
    missing: dict[str, str] = {}
    if tokens <= 0:
        return {"processes": {}, "missing": {"*": "no completion tokens were generated"}}
    for role in sorted(set(before.procs) | set(after.procs)):
        b, a = before.procs.get(role), after.procs.get(role)
        why = None
        if b is None:
            why = "appeared during the measurement"
        elif a is None:
            why = "no longer among the server's processes when the measurement ended"
        elif isinstance(b, str) or isinstance(a, str):
            why = b if isinstance(b, str) else a
        elif (a.pid, a.create_time) != (b.pid, b.create_time):
            why = f"pid {b.pid} was replaced by pid {a.pid} during the measurement"
        if why is not None:
            procs[role], missing[role] = None, why
            continue
        du, ds = a.user - b.user, a.system - b.system
        procs[role] = {"pid": a.pid, "user": _us(du, tokens), "system": _us(ds, tokens),
                       "total": _us(du + ds, tokens),
                       "threads": _threads(b, a, du + ds, tokens)}
    inside = [v for k, v in procs.items() if k not in outside]
    total = (None if any(v is None for v in inside) or not inside
             else round(sum(v["total"] for v in inside), 1))
    busy, window = after.machine_busy - before.machine_busy, after.at - before.at
    n = os.cpu_count() or 1
    return {"processes": procs, "deployment_total": total,
            "machine_busy": _us(busy, tokens),
            "machine_busy_fraction": round(busy / (window * n), 3) if window > 0 else None,
            "window_s": round(window, 3),
            "clock_tick_us_per_token": _us(CLOCK_TICK_S, tokens), "missing": missing}


def cpus() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"logical": os.cpu_count(), "usable": usable}


def compact(bd: dict) -> dict:
    """The summary's per-process view: role -> {total, user, system[, main,
    other_threads]} µs/token (null where the process could not be measured)."""
    out: dict = {}
    for role, p in (bd.get("processes") or {}).items():
        if p is None:
            out[role] = None
            continue
        row = {k: p[k] for k in ("total", "user", "system")}
        if p.get("threads"):
            for k in ("busiest_thread", "python_main_thread", "other_threads"):
                row[k] = p["threads"][k]
        out[role] = row
    for k in ("deployment_total", "machine_busy", "machine_busy_fraction"):
        if k in bd:
            out[k] = bd[k]
    return out
