"""`lockstep admin status` in human form (`status.Reply.render`), and what `lockstep admin
watch` redraws every second in place: pure rendering of the supervisor's `status` reply.

Per deployment: state, model, shape, uptime, and its prefix cache (rank 0 decides hits);
per rank: host, pid, phase, step, steps/s (watch only: the step's rate between two
replies; in lockstep every rank takes the same steps, each step one token for every
request decoding), active, memory, telemetry age, cancel epoch seen/acked, load progress
while loading; then the rejected-message counters and the last incidents from the
supervisor's journal (`status.events`: state changes with their teardown outcome,
incidents, reaps), newest first — the same reading as the console's page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from common.deployment_info import DeploymentInfo, RankInfo
from common.messages.admin import Event
from common.messages.commands.status_record import StatusRecord
from common.messages.vocab import (
    TORN_DOWN,
    DeploymentState,
    EventName,
    EventTopic,
    ReapOutcome,
)

INCIDENTS = 8
# A deployment is born launching: its first state event is loading.
FIRST_EVENT = DeploymentState.LOADING


@dataclass(frozen=True)
class Incident:
    at: float
    kind: str
    deployment_id: str
    what: str
    detail: str = ""


def _ladder(outcome: Any) -> str:
    if not isinstance(outcome, dict):
        return ""
    path = " -> ".join(outcome.get("path") or []) or "none alive"
    proven = "NOT proven" if outcome.get("proven") is False else "proven"
    return f"teardown {path} ({proven})"


def _incident(e: Event) -> Incident | None:
    at, dep, reason, data = e.at, e.deployment_id, e.reason, e.data
    if e.topic == EventTopic.INCIDENT:
        return Incident(at, e.name.value, dep, reason, _ladder(data.get("outcome")))
    if e.topic == EventTopic.DEPLOYMENT and e.name == EventName.TEARDOWN:
        return Incident(at, "teardown", dep, reason, _ladder(data.get("outcome")))
    if e.topic == EventTopic.DEPLOYMENT and e.name == EventName.STATE:
        if e.state in TORN_DOWN:
            return Incident(at, e.state.value, dep, reason, _ladder(data.get("teardown")))
        if e.state == FIRST_EVENT:
            return Incident(at, "deploy", dep, f"launched: {reason}")
        if e.state == DeploymentState.SERVING:
            return Incident(at, "serving", dep, reason)
        return None
    if e.topic == EventTopic.REAP:
        if e.name == EventName.PASS and not (data.get("reaped")
                                             or e.outcome == ReapOutcome.BLOCKED):
            return None  # a pass that found nothing: not an incident
        detail = ""
        if e.name == EventName.REAPED:
            detail = (f"job {data.get('job_id')}, {data.get('ranks')} rank(s), "
                      + (" -> ".join(data.get("path") or []) or "none alive"))
        return Incident(at, f"reap {e.name.value}", dep, reason, detail)
    return None


def incidents(events: list[Event]) -> list[Incident]:
    """The journal's incidents, newest first; a deploy after a loss is a redeploy."""
    out: list[Incident] = []
    lost = False
    for e in events:
        if (inc := _incident(e)) is None:
            continue
        # decided on the event, never on the incident's text
        if e.name == EventName.RANK_LOST or (e.name == EventName.STATE
                                             and e.state == DeploymentState.FAILED):
            lost = True
        elif e.name == EventName.STATE and e.state == FIRST_EVENT and lost:
            inc, lost = Incident(inc.at, "redeploy", inc.deployment_id, inc.what), False
        out.append(inc)
    return out[::-1]


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def age(s: float | None) -> str:
    if s is None or s < 0:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def cache_text(d: DeploymentInfo) -> str:
    c = next((r.cache for r in d.ranks if r.rank == 0), None)
    if c is None:
        return "prefix cache off (or no telemetry yet)"
    looked = c.hits + c.misses
    rate = f"{100 * c.hits / looked:.0f}%" if looked else "-"
    disk = (f"; disk {c.disk_entries} entries, {mib(c.disk_bytes)}, "
            f"{c.disk_hits} hits ({c.disk_hit_tokens} tokens), {c.disk_rejected} rejected"
            + (f", {c.disk_write_errors} write errors" if c.disk_write_errors else "")
            if c.disk_entries or c.disk_hits or c.disk_written or c.disk_rejected else "")
    return (f"prefix cache {c.entries} entries, {c.tokens} tokens, {mib(c.bytes)}; "
            f"hits {c.hits}/{looked} ({rate}), {c.hit_tokens} prompt tokens served, "
            f"{c.evicted} evicted{disk}")


def kv_text(d: DeploymentInfo) -> str:
    """The KV budget line: per rank, what its caches hold (and held at most) of the
    budget; rank 0's reservation, queue head and refusals."""
    r0 = next((r.kv for r in d.ranks if r.rank == 0), None)
    if r0 is None:
        return "KV budget: no telemetry yet"
    if not r0.budget:
        return "KV budget: off (--kv-budget-bytes 0)"
    if not r0.slot_bytes:
        return f"KV budget: {mib(r0.budget)} per rank NOT enforced (this model's cache)"
    held = ", ".join(f"rank {r.rank} {mib(r.kv.held)} (peak {mib(r.kv.held_peak)})"
                     for r in d.ranks if r.kv is not None)
    return (f"KV budget: {mib(r0.budget)} per rank; held {held}; reserved {mib(r0.reserved)}; "
            f"queue head {'waits for room' if r0.waiting else 'not waiting'} "
            f"({r0.waits} waits), {r0.preemptions} preempted, {r0.refused} refused as too large")


def queue_text(d: DeploymentInfo) -> str:
    """Rank 0's queue: waiting requests by priority and by API key (tenant)."""
    r0 = next((r.kv for r in d.ranks if r.rank == 0), None)
    if r0 is None or not r0.queued_by_priority:
        return "rank 0's queue: empty"
    prio = ", ".join(f"priority {p}: {n}" for p, n in sorted(
        r0.queued_by_priority.items(), key=lambda kv: int(kv[0])))
    keys = ", ".join(f"{t or '(open)'}: {n}" for t, n in sorted(r0.queued_by_tenant.items()))
    return f"rank 0's queue: {prio}; by key {keys}"


def _rate(r: RankInfo, dep_id: str, prev: dict[tuple, tuple[int, float]] | None) -> str:
    if prev is None:
        return "-"
    p = prev.get((dep_id, r.rank, r.pid))
    if p is None or r.last_seen <= p[1]:
        return "-"
    return f"{(r.step - p[0]) / (r.last_seen - p[1]):.1f}"


def render(reply: StatusRecord, *, now: float | None = None,
           prev: dict[tuple, tuple[int, float]] | None = None) -> str:
    """The status reply as text. `prev` (watch): the last reply's steps(), for steps/s."""
    now = time.time() if now is None else now
    s = reply.supervisor
    lines = [f"supervisor pid {s.pid} up {age(s.uptime_s)} home {s.home} "
             f"cancel epoch {reply.cancel_epoch}"]
    if s.restarts is not None:
        lines.append(f"  {s.restarts.describe()}")
    events = reply.events
    for d in reply.deployments:
        serving = [e.at for e in events if e.deployment_id == d.deployment_id
                   and e.name == EventName.STATE and e.state == DeploymentState.SERVING]
        up = (f" up {age(now - serving[-1])}"
              if d.state == DeploymentState.SERVING and serving else "")
        replica = f" replica {d.replica + 1}/{d.replicas}" if d.replicas > 1 else ""
        lines.append(f"{d.deployment_id}  {d.state}{up}  {d.model}{replica} tp={d.tp} pp={d.pp} "
                     f"backend={d.backend} job={d.job_id}" + (f"  error: {d.error}" if d.error else ""))
        lines.append(f"  {cache_text(d)}")
        lines.append(f"  {kv_text(d)}")
        lines.append(f"  {queue_text(d)}")
        lines.append(f"  sampling defaults: {d.sampling.describe()}")
        lines.append(f"  deterministic: {determinism_text(d.determinism)}")
        lines.append(f"  speculative: {speculation_text(d.speculation)}")
        lines.append(f"  {'rank':>4} {'host':<16} {'pid':>7} {'phase':<13} {'step':>7} "
                     f"{'steps/s':>7} {'active':>6} {'memory':>10} {'seen':>6}  epoch seen/acked")
        for r in d.ranks:
            seen = age(now - r.last_seen) if r.last_seen else "-"
            host = r.host + ("*" if r.remote else "")
            load = ""
            if r.load is not None and r.load.total_bytes:
                load = (f"  load {100 * min(r.load.read_bytes, r.load.total_bytes) // r.load.total_bytes}%"
                        f" of {mib(r.load.total_bytes)}")
            lines.append(f"  {r.rank:>4} {host:<16} {r.pid:>7} {r.phase:<13} {r.step:>7} "
                         f"{_rate(r, d.deployment_id, prev):>7} {r.active:>6} "
                         f"{mib(r.mem_active):>10} {seen:>6}  {r.cancel_epoch}/{r.acked_epoch}{load}")
    if not reply.deployments:
        lines.append("no deployments")
    for rj in reply.rejections:
        lines.append(f"rejected {rj.service}/{rj.socket} {rj.reason}: {rj.count}")
    last = incidents(events)[:INCIDENTS]
    if last:
        lines.append("last incidents (newest first):")
        for inc in last:
            stamp = time.strftime("%H:%M:%S", time.localtime(inc.at))
            lines.append(f"  {stamp} {inc.kind:<15} {inc.deployment_id or '-'}  {inc.what}"
                         + (f"  [{inc.detail}]" if inc.detail else ""))
    return "\n".join(lines)


def speculation_text(mode) -> str:
    """A deployment's `speculation` as status and the banner say it."""
    if mode is None:
        return "? (rank 0 not ready)"
    if mode.value == "off":
        return "off"
    return (f"{mode.value} (rank 0 proposes drafts, every rank verifies them in one step; "
            "tokens as without; a request opts out with \"speculative\": false)")


def determinism_text(mode) -> str:
    """A deployment's `determinism` as status, the banner and the console say it."""
    return {None: "? (no rank ready yet)", "on": "on (batch-invariant)",
            "unverified": "on, unverified for this architecture",
            "off": "off (--no-deterministic)"}[None if mode is None else mode.value]
