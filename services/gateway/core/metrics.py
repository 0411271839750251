"""Prometheus metrics for the whole cluster, as the gateway sees it.

The gateway's own series (requests, tokens, aborts by cause, TTFT twice, per-token
latency, prefix-cache hits / misses / cached tokens counted per request from rank 0's
`cached_tokens`) are ordinary instruments on a per-app registry; per deployment, requests in
flight, their bound and the 429s it caused (`lockstep_gateway_overloaded_total`, by
bound: this gateway's, or rank 0's) are read from the backends at scrape time, with each
one's precise prefix index (rank 0's cache events applied, gaps, resyncs, entries:
services/gateway/core/cache_index.py). What the supervisor,
reaper and ranks report (rank telemetry, each rank's prefix cache: entries, tokens,
bytes, stored and evicted entries; each rank's wall seconds and runs per loop phase,
services/rank/phase_clock.py; cancel epochs, deployment states, bus
rejections by service and reason, teardown and reap outcomes) is collected at scrape
time from the gateway's last cluster refresh, so a scrape never waits on the bus.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.envelope import REGISTRY as REJECTS
from common.schema import to_wire
from services.gateway.core.cache_index import metric_families as cache_index_families
from services.gateway.core.refusals import Bound

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("lockstep_gateway_requests", "HTTP generation requests by outcome",
                                ["endpoint", "model", "outcome"], registry=r)
        self.tokens = Counter("lockstep_gateway_tokens", "Tokens processed",
                              ["model", "kind"], registry=r)
        self.aborts = Counter("lockstep_gateway_aborts", "Requests aborted, by cause",
                              ["cause"], registry=r)
        self.ttft_model = Histogram("lockstep_ttft_model_seconds",
                                    "Model TTFT: rank 0 produced the first token",
                                    ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.ttft_visible = Histogram("lockstep_ttft_visible_seconds",
                                      "Visible TTFT: first byte of visible content sent",
                                      ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("lockstep_token_latency_seconds",
                                       "Time between consecutive tokens of one request",
                                       ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.cache_hits = Counter("lockstep_gateway_prefix_cache_hits",
                                  "Requests whose prompt started from rank 0's prefix cache",
                                  ["model"], registry=r)
        self.cache_misses = Counter("lockstep_gateway_prefix_cache_misses",
                                    "Requests prefilled without the prefix cache", ["model"],
                                    registry=r)
        self.cached_tokens = Counter("lockstep_gateway_prefix_cache_cached_tokens",
                                     "Prompt tokens served from the prefix cache", ["model"],
                                     registry=r)
        self.resumes = Counter("lockstep_gateway_resumes",
                               "Requests resumed on another deployment after theirs failed, "
                               "by cause", ["cause"], registry=r)
        self.resume_gave_up = Counter("lockstep_gateway_resume_gave_up",
                                      "Requests whose resume gave up (resume_timeout or "
                                      "resume_max), by cause", ["cause"], registry=r)
        self.resume_first_token = Histogram(
            "lockstep_gateway_resume_first_token_seconds",
            "From a request's failure to its first token after resuming",
            buckets=TTFT_BUCKETS + (120,), registry=r)
        self.routes = Counter("lockstep_gateway_routes",
                              "Requests routed to a deployment, by the rule that chose it "
                              "(services/gateway/core/router.py)", ["deployment", "reason"],
                              registry=r)
        self.admin_calls = Counter("lockstep_gateway_admin_calls", "Admin API calls by outcome",
                                   ["command", "code"], registry=r)
        self.cluster = None  # set by the app: the Cluster whose state is exported
        r.register(_ClusterCollector(self))

    def prefix_cache(self, model: str, cached_tokens: int) -> None:
        """One request rank 0 prefilled: a hit if the cache served part of its prompt."""
        if cached_tokens > 0:
            self.cache_hits.labels(model=model).inc()
            self.cached_tokens.labels(model=model).inc(cached_tokens)
        else:
            self.cache_misses.labels(model=model).inc()


class _ClusterCollector:
    def __init__(self, m: Metrics) -> None:
        self.m = m

    def describe(self):
        return []

    def collect(self):
        c = self.m.cluster
        active = GaugeMetricFamily("lockstep_gateway_active_requests",
                                   "Requests in flight through this gateway", labels=["deployment"])
        limit = GaugeMetricFamily("lockstep_gateway_inflight_limit",
                                  "Requests in flight beyond which a new one gets 429",
                                  labels=["deployment"])
        overloaded = CounterMetricFamily("lockstep_gateway_overloaded",
                                         "Requests refused with 429: the bound on in flight "
                                         "(gateway) or rank 0's on open requests (rank)",
                                         labels=["deployment", "bound"])
        dep_state = GaugeMetricFamily("lockstep_deployment_state", "1 for the current state",
                                      labels=["deployment", "model", "state"])
        rank_g = {n: GaugeMetricFamily(f"lockstep_rank_{n}", h, labels=["deployment", "rank"])
                  for n, h in (("step", "Decode steps done"), ("active", "Active requests"),
                               ("cancel_epoch", "Last consumed cancel epoch"),
                               ("acked_epoch", "Last acknowledged cancel epoch"),
                               ("mem_active_bytes", "MLX active memory"),
                               ("telemetry_age_seconds", "Seconds since the last telemetry"))}
        cache_g = {n: GaugeMetricFamily(f"lockstep_rank_prefix_cache_{n}", h,
                                        labels=["deployment", "rank"])
                   for n, h in (("entries", "Prefix-cache entries held"),
                                ("tokens", "Tokens the prefix-cache entries cover"),
                                ("bytes", "Prefix-cache KV bytes held on this rank"),
                                ("disk_entries", "Prefix-cache entries on this rank's disk"),
                                ("disk_bytes", "Prefix-cache bytes on this rank's disk"))}
        cache_c = {n: CounterMetricFamily(f"lockstep_rank_prefix_cache_{n}", h,
                                          labels=["deployment", "rank"])
                   for n, h in (("stored", "Prefix-cache entries stored"),
                                ("evicted", "Prefix-cache entries evicted"),
                                ("hits", "Prefix-cache hits, either tier (rank 0)"),
                                ("hit_tokens", "Prompt tokens served by hits, either tier"),
                                ("disk_hits", "Prefix-cache hits read from disk (rank 0)"),
                                ("disk_hit_tokens", "Prompt tokens served from disk"),
                                ("disk_written", "Prefix-cache entries written to disk"),
                                ("disk_write_errors", "Prefix-cache disk writes that failed"),
                                ("disk_rejected", "Disk entries that failed their check "
                                 "(tampered, truncated, foreign) and were removed"),
                                ("disk_loaded", "Disk entries read back into memory"))}
        kv_g = {n: GaugeMetricFamily(f"lockstep_rank_kv_{n}", h, labels=["deployment", "rank"])
                for n, h in (("budget", "KV budget per rank in bytes (0: none)"),
                             ("held", "KV bytes the batch's caches allocate on this rank"),
                             ("held_peak", "Most KV bytes the batch's caches held after a step"),
                             ("reserved", "KV bytes rank 0 reserves for the batch (rank 0)"),
                             ("waiting", "1 while the queue's head waits for the budget"))}
        kv_c = {n: CounterMetricFamily(f"lockstep_rank_kv_{n}", h, labels=["deployment", "rank"])
                for n, h in (("waits", "Plans whose queue head waited for the KV budget"),
                             ("refused", "Requests refused: more KV than the budget alone"),
                             ("preemptions", "Requests preempted for the KV budget (rank 0)"))}
        spec_c = {n: CounterMetricFamily(f"lockstep_rank0_spec_{n}", h, labels=["deployment"])
                  for n, h in (("verify_steps", "Steps that verified drafts (rank 0)"),
                               ("verify_rows", "Rows those steps verified drafts for"),
                               ("proposed", "Drafts proposed by rank 0"),
                               ("accepted", "Drafts accepted: tokens emitted past one per "
                                "verifying row"))}
        queued = {n: GaugeMetricFamily(f"lockstep_rank0_queued_by_{n}",
                                       f"Requests waiting in rank 0's queue, by {n}",
                                       labels=["deployment", n]) for n in ("priority", "tenant")}
        phase_c = {n: CounterMetricFamily(f"lockstep_rank_phase_{n}", h,
                                          labels=["deployment", "rank", "phase"])
                   for n, h in (("seconds", "Wall seconds a rank's threads spent per loop phase"),
                                ("runs", "Runs of each loop phase on a rank"))}
        rejects = CounterMetricFamily("lockstep_bus_rejected", "Bus messages rejected",
                                      labels=["service", "socket", "reason"])
        up = GaugeMetricFamily("lockstep_supervisor_up", "1 if the supervisor answered lately")
        epoch = GaugeMetricFamily("lockstep_cluster_cancel_epoch", "Supervisor cancel epoch")
        extra: list[Any] = []
        total = 0
        seen: set[tuple] = set()
        for row in REJECTS.snapshot():
            key = (row["service"], row["socket"], row["reason"])
            seen.add(key)
            rejects.add_metric(list(key), row["count"])
        if c is not None:
            now = time.time()
            for dep_id, b in c.backends.items():
                active.add_metric([dep_id], b.active)
                total += b.active
                limit.add_metric([dep_id], b.max_inflight)
                for bound in Bound:
                    overloaded.add_metric([dep_id, bound.value], b.overloads[bound])
            for dep_id, d in c.deployments.items():  # DeploymentInfo, decoded once
                dep_state.add_metric([dep_id, d.model, str(d.state)], 1)
                for rk in d.ranks:
                    labels = [dep_id, str(rk.rank)]
                    for name, value in (("step", rk.step), ("active", rk.active),
                                        ("cancel_epoch", rk.cancel_epoch),
                                        ("acked_epoch", rk.acked_epoch),
                                        ("mem_active_bytes", rk.mem_active)):
                        rank_g[name].add_metric(labels, value)
                    if rk.cache is not None:  # None: the cache is off (or no telemetry yet)
                        for name, fam in (*cache_g.items(), *cache_c.items()):
                            fam.add_metric(labels, getattr(rk.cache, name))
                    if rk.kv is not None:  # None: a rank older than the KV budget
                        for name, fam in (*kv_g.items(), *kv_c.items()):
                            fam.add_metric(labels, getattr(rk.kv, name))
                        for name, by in (("priority", rk.kv.queued_by_priority),
                                         ("tenant", rk.kv.queued_by_tenant)):
                            for key, n in by.items():
                                queued[name].add_metric([dep_id, key], n)
                    if rk.spec is not None:  # rank 0 speculating
                        for name, fam in spec_c.items():
                            fam.add_metric([dep_id], getattr(rk.spec, name))
                    if rk.phases is not None:  # None: a rank older than the phase clock
                        for name, times in (("seconds", rk.phases.seconds),
                                            ("runs", rk.phases.counts)):
                            for phase, v in times.items():
                                phase_c[name].add_metric([*labels, phase], v)
                    rank_g["telemetry_age_seconds"].add_metric(labels, max(0.0, now - rk.last_seen))
            st = c.status
            up.add_metric([], 0.0 if c.supervisor_error else 1.0)
            if st is not None:
                epoch.add_metric([], st.cancel_epoch)
            for row in [*(to_wire(st.rejections) if st else []), *c.reaper_rejections]:
                key = (row["service"], row["socket"], row["reason"])
                if key not in seen:
                    seen.add(key)
                    rejects.add_metric(list(key), row["count"])
            if st is not None:
                extra += _numbers("lockstep_reaper", to_wire(st.reaper), "Reaper outcome counters")
                extra += _numbers("lockstep_supervisor", to_wire(st.supervisor), "Supervisor counters")
            extra += cache_index_families(c.backends.values())
        active.add_metric(["all"], total)
        yield from (active, limit, overloaded, dep_state, *rank_g.values(), *cache_g.values(),
                    *cache_c.values(), *kv_g.values(), *kv_c.values(), *spec_c.values(),
                    *queued.values(), *phase_c.values(), rejects, up, epoch, *extra)


def _numbers(prefix: str, obj: Any, doc: str) -> list:
    """Flat numeric fields of a status section (e.g. teardowns ok/failed) as gauges."""
    out = []
    if isinstance(obj, dict):
        for k, v in sorted(obj.items()):
            if isinstance(v, bool):
                v = int(v)
            if isinstance(v, int | float) and k.replace("_", "").isalnum():
                g = GaugeMetricFamily(f"{prefix}_{k}", f"{doc}: {k}")
                g.add_metric([], v)
                out.append(g)
    return out
