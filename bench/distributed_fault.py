"""The fault half of bench/distributed_vs_mlx_lm.py: SIGKILL one non-zero rank of a TP=2
server while 4 streams are mid-generation, then record, every wait bounded:

- per client, what it saw: `error_event` (an SSE `error` object or finish_reason
  "error", or a non-200 status), `aborted` (the connection ended or was reset with no
  error and no [DONE]), `completed` (it finished normally anyway), `still_streaming` or
  `hung` (nothing ended it within `client_bound_s` of the kill; the bench then closed it:
  tokens in the last 5 s make it still_streaming, none make it hung);
- recovery: seconds from the kill until a new short request is served start to finish
  (status 200, a token, [DONE], no error), probed once a second, each attempt bounded;
  null if none was within `recover_bound_s`, with what the attempts got;
- survivors: `survey_after_s` after the kill, every process of the server's tree and
  every process whose command line names the run's work directory: role, status, and
  whether it was there before the kill or was started after it (a redeploy).

A peer that hangs is a result here, not a failure: nothing waits without a bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psutil

from bench.cpu_breakdown import role_of
from bench.sse_http import post_json

STREAMING_RECENT_S = 5.0  # a token this recently at the bound: still streaming, not hung


@dataclass
class Stream:
    index: int
    prompt_tokens_approx: int
    chunks_before_kill: int = 0
    chunks_after_kill: int = 0
    outcome: str = "pending"
    detail: str = ""
    status: int | None = None
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)
    done: bool = False  # data: [DONE] seen
    ended_after_kill_s: float | None = None
    last_chunk_at: float | None = None


def _body(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


async def _read_stream(url: str, model: str, messages: list[dict], max_tokens: int,
                       st: Stream, clock: dict) -> None:
    """One stream to its end, whatever ends it; the verdict is written into `st`."""
    resp = None
    try:
        resp = await post_json(url + "/v1/chat/completions", _body(model, messages, max_tokens),
                               timeout=60)
        st.status = resp.status
        if resp.status != 200:
            body = await asyncio.wait_for(resp.read(), 30)
            st.outcome, st.detail = "error_event", f"HTTP {resp.status}: {body[:300]!r}"
            return
        async for line in resp.lines():
            if line == "data: [DONE]":
                st.done = True
            if not line.startswith("data: ") or st.done:
                continue
            d = json.loads(line[6:])
            if d.get("error"):
                st.errors.append(json.dumps(d["error"])[:300])
            for ch in d.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    st.last_chunk_at = time.monotonic()
                    if clock.get("kill") is None:
                        st.chunks_before_kill += 1
                    else:
                        st.chunks_after_kill += 1
                if ch.get("finish_reason"):
                    st.finish_reason = ch["finish_reason"]
        if st.errors or st.finish_reason == "error":
            st.outcome = "error_event"
            st.detail = "; ".join(st.errors) or "finish_reason error"
        elif st.done:
            st.outcome, st.detail = "completed", f"finish_reason {st.finish_reason}"
        else:
            st.outcome, st.detail = "aborted", "connection closed: no [DONE], no error"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        st.outcome = "error_event" if st.errors else "aborted"
        st.detail = f"{type(exc).__name__}: {exc}"[:300] + (f"; {st.errors}" if st.errors else "")
    finally:
        if resp is not None:
            resp.close()
        if clock.get("kill") is not None:
            st.ended_after_kill_s = round(time.monotonic() - clock["kill"], 2)


async def _probe(url: str, model: str, i: int) -> str | None:
    """A short new request; None when it was served start to finish, else what went wrong."""
    msgs = [{"role": "user", "content": f"Probe {i}: after the fault, is anyone serving?"}]
    st = Stream(-1, 0)
    await _read_stream(url, model, msgs, 8, st, {})
    if st.outcome == "completed" and st.chunks_before_kill > 0:
        return None
    return f"{st.outcome}: {st.detail}"[:200]


async def _recover(url: str, model: str, clock: dict, bound_s: float,
                   attempt_s: float = 30.0) -> dict:
    attempts: list[dict] = []
    i = 0
    while (left := bound_s - (time.monotonic() - clock["kill"])) > 0:
        t0 = time.monotonic()
        try:
            err = await asyncio.wait_for(_probe(url, model, i), min(attempt_s, left))
        except TimeoutError:
            err = f"no answer within {min(attempt_s, left):.0f} s"
        attempts.append({"at_s": round(t0 - clock["kill"], 2),
                         "took_s": round(time.monotonic() - t0, 2), "error": err})
        if err is None:
            return {"served_after_kill_s": round(time.monotonic() - clock["kill"], 2),
                    "attempts": len(attempts), "failed_attempts": _squeeze(attempts[:-1])}
        i += 1
        await asyncio.sleep(1.0)
    return {"served_after_kill_s": None, "bound_s": bound_s, "attempts": len(attempts),
            "failed_attempts": _squeeze(attempts)}


def _squeeze(attempts: list[dict], keep: int = 4) -> list[dict]:
    """The first and last few attempts (a server that never recovers makes hundreds)."""
    if len(attempts) <= 2 * keep:
        return attempts
    return [*attempts[:keep], {"omitted": len(attempts) - 2 * keep}, *attempts[-keep:]]


def _role(p: psutil.Process, root_pid: int) -> str:
    try:
        cmd = p.cmdline()
        if (r := role_of(cmd)) is not None:
            return r
        rank = p.environ().get("MLX_RANK")
        if rank is not None:
            return f"rank_{rank}"
        if p.pid == root_pid or any("mlx.launch" in a for a in cmd[:2]):
            return "launcher" if any("mlx.launch" in a for a in cmd[:2]) else "root"
        return " ".join(os.path.basename(a) for a in cmd[:3])
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "unknown"


def processes(root_pid: int, needles: tuple[str, ...]) -> list[psutil.Process]:
    """The tree under root_pid plus every process whose command line names a needle."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        for p in (root, *root.children(recursive=True)):
            found[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    me = os.getpid()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if p.pid != me and any(n in cmd for n in needles):
            found.setdefault(p.pid, p)
    return list(found.values())


def survey(root_pid: int, needles: tuple[str, ...], kill_wall: float,
           before: set[int]) -> list[dict]:
    out = []
    for p in processes(root_pid, needles):
        try:
            out.append({"pid": p.pid, "role": _role(p, root_pid), "status": p.status(),
                        "present_before_kill": p.pid in before,
                        "started_after_kill": p.create_time() > kill_wall,
                        "cmd": " ".join(p.cmdline()[:5])[:160]})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(out, key=lambda r: r["role"])


def rank_pid(root_pid: int, needles: tuple[str, ...], rank: int) -> int | None:
    for p in processes(root_pid, needles):
        try:
            if p.environ().get("MLX_RANK") == str(rank) and "python" in p.name():
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


@dataclass
class FaultConfig:
    streams: int = 4
    max_tokens: int = 1500  # long enough that no stream ends before the kill
    kill_after_chunks: int = 8  # every stream has streamed this many chunks first
    kill_wait_bound_s: float = 300.0
    kill_rank: int = 1
    client_bound_s: float = 60.0
    survey_after_s: float = 60.0
    recover_bound_s: float = 180.0


async def _fault(url: str, model: str, prompts: list[list[dict]], cfg: FaultConfig,
                 root_pid: int, needles: tuple[str, ...], log: Callable[[str], None]) -> dict:
    clock: dict = {}
    streams = [Stream(i, len(m[0]["content"]) // 4) for i, m in enumerate(prompts)]
    tasks = [asyncio.create_task(_read_stream(url, model, m, cfg.max_tokens, st, clock))
             for m, st in zip(prompts, streams, strict=True)]
    t0 = time.monotonic()
    while (time.monotonic() - t0 < cfg.kill_wait_bound_s
           and not all(s.chunks_before_kill >= cfg.kill_after_chunks for s in streams)
           and not all(t.done() for t in tasks)):
        await asyncio.sleep(0.05)
    victim = rank_pid(root_pid, needles, cfg.kill_rank)
    before = {p.pid for p in processes(root_pid, needles)}
    out: dict = {"config": asdict(cfg), "waited_for_streams_s": round(time.monotonic() - t0, 2),
                 "chunks_at_kill": [s.chunks_before_kill for s in streams],
                 "ended_before_kill": [s.index for s, t in zip(streams, tasks, strict=True)
                                       if t.done()],
                 "processes_before_kill": survey(root_pid, needles, time.time(), set())}
    if victim is None:
        for t in tasks:
            t.cancel()
        out["error"] = f"no rank {cfg.kill_rank} process found"
        return out
    os.kill(victim, signal.SIGKILL)
    clock["kill"], kill_wall = time.monotonic(), time.time()
    out["killed"] = {"rank": cfg.kill_rank, "pid": victim, "signal": "SIGKILL"}
    log(f"    SIGKILL rank {cfg.kill_rank} (pid {victim}) at chunks {out['chunks_at_kill']}")
    recovery = asyncio.create_task(_recover(url, model, clock, cfg.recover_bound_s))
    done, pending = await asyncio.wait(tasks, timeout=cfg.client_bound_s)
    now = time.monotonic()
    for st, t in zip(streams, tasks, strict=True):
        if t in pending:
            recent = st.last_chunk_at is not None and now - st.last_chunk_at < STREAMING_RECENT_S
            st.outcome = "still_streaming" if recent else "hung"
            st.detail = (f"not ended {cfg.client_bound_s:.0f} s after the kill "
                         f"(closed by the bench); {st.chunks_after_kill} chunks after the kill")
            t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    left = cfg.survey_after_s - (time.monotonic() - clock["kill"])
    if left > 0:
        await asyncio.sleep(left)
    out["survey_at_s"] = round(time.monotonic() - clock["kill"], 2)
    out["processes_after"] = await asyncio.to_thread(survey, root_pid, needles, kill_wall, before)
    out["recovery"] = await recovery
    out["clients"] = [{k: v for k, v in asdict(s).items() if k not in ("last_chunk_at", "done")}
                      for s in streams]
    out["client_outcomes"] = sorted(s.outcome for s in streams)
    alive = [p for p in out["processes_after"] if p["status"] != psutil.STATUS_ZOMBIE]
    out["left_running"] = {
        "from_before_kill": sorted(p["role"] for p in alive if p["present_before_kill"]),
        "started_after_kill": sorted(p["role"] for p in alive if p["started_after_kill"]),
    }
    return out


def run_fault(url: str, model: str, prompts: list[list[dict]], cfg: FaultConfig,
              root_pid: int, needles: tuple[str, ...], log: Callable[[str], None] = print) -> dict:
    """The fault on one running server; every wait bounded (see the module docstring)."""
    return asyncio.run(_fault(url, model, prompts, cfg, root_pid, needles, log))
