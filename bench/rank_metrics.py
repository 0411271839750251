"""What Lockstep's ranks say about a trial, read from the gateway's /metrics: rank 0's
token latency, and each rank's wall time per loop phase (services/rank/phase_clock.py,
`lockstep_rank_phase_seconds_total`) turned into µs per completion token between two
reads around the trial. Used by bench/gateway.py's measurements of Lockstep.
"""

from __future__ import annotations

import re
import time

import httpx

from bench import servers as sv


def rank_token_latency(srv: sv.Server) -> tuple[float, float]:
    """(token latency sum, count) from rank 0's /metrics."""
    tot = cnt = 0.0
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lockstep_token_latency_seconds_sum"):
            tot += float(line.split()[-1])
        elif line.startswith("lockstep_token_latency_seconds_count"):
            cnt += float(line.split()[-1])
    return tot, cnt


# Rank phase counters reach /metrics by rank telemetry (every rank_telemetry_interval_s,
# 1 s) and the gateway's deployments refresh (on events, else every refresh_s, 2 s): a
# read taken right after a trial can be ~3 s stale. Each read therefore waits until every
# rank's sample was received after the read began (telemetry age, bounded by
# PHASE_FRESH_S; the age counts from any report, and a run sends no cancels whose acks
# could pass for one): the ranks are idle before and after a trial, so the difference of
# two such reads is exactly the trial's work, whatever the telemetry interval.
PHASE_FRESH_S = 15.0
PHASE_MARGIN_S = 0.25  # a sample is taken this long before the supervisor has it, at most
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def series(text: str, name: str) -> dict[str, dict[str, float]]:
    """{rank: {phase or "": value}} of metric `name` in a /metrics text."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            labels = dict(_LABEL.findall(head))
            out.setdefault(labels.get("rank", ""), {})[labels.get("phase", "")] = float(value)
    return out


def rank_phases(srv: sv.Server) -> dict[str, dict[str, float]] | None:
    """{rank: {phase: seconds}} from /metrics, from telemetry newer than this call (see
    PHASE_FRESH_S); None if no fresh sample came in time."""
    since = time.time() + PHASE_MARGIN_S
    deadline = time.monotonic() + PHASE_FRESH_S
    while time.monotonic() < deadline:
        asked = time.time()
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        ages = series(text, "lockstep_rank_telemetry_age_seconds")
        phases = series(text, "lockstep_rank_phase_seconds_total")
        # asked - age <= when the supervisor got the sample: never judged fresher than it is
        if ages and phases and all(asked - a[""] >= since for a in ages.values()):
            return phases
        time.sleep(0.2)
    return None


def phase_us_per_token(before: dict | None, after: dict | None, toks: int) -> dict | None:
    """{"rank_R": {phase: µs of wall time per completion token}} between two reads."""
    if before is None or after is None or not toks:
        return None
    return {f"rank_{r}": {p: round((v - before.get(r, {}).get(p, 0.0)) / toks * 1e6, 3)
                          for p, v in sorted(ph.items())}
            for r, ph in sorted(after.items())}
