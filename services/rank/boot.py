"""Start-up of one rank, up to the serve release.

    marker starting → I/O thread (control SUB, report DEALER, plan, requests)
    → watchdog thread (launcher, progress, peers: services.rank.watchdog_thread)
    → wait for one LEASE (slow-joiner proof)              → marker loading
    → mx.distributed.init (MLX_RANK / MLX_HOSTFILE; ring, jaccl or mpi)
    → load the shard (sharded_load: tensor_group for TP, pipeline_group for PP;
      a single rank loads the whole model)
    → warm-up: one throwaway generation, the same on every rank (services.rank.warmup)
    → plan session: followers HELLO until rank 0 WELCOMEs; rank 0 waits for all
    → marker ready + RANK_READY (re-sent until SERVE)     → SERVE → marker serving
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import mlx.core as mx

from common.keys import KeyFileError, LaunchKeys, read_secret_file
from common.messages import Backend, Determinism, KvStats, Phase, RankReady, Speculation
from common.rankspec import RankSettings, RankSpec
from services.rank import events as ev
from services.rank.disk_open import open_disk_tier
from services.rank.disk_report import DISK_FLUSH_S, boot_report
from services.rank.engine import Engine
from services.rank.errors import StartupError
from services.rank.grammar import RankGrammars
from services.rank.io import RankIO
from services.rank.kv_budget import KvBudget
from services.rank.outbox import AnnounceReady, Served
from services.rank.process_exit import EXIT_FAILED, EXIT_OK
from services.rank.removals import RemovalLog, removals_path
from services.rank.runtime import RankRuntime
from services.rank.warmup import WarmReport, warm_up
from services.rank.watchdog_thread import RankSide, Watchdogs
from services.rank.watchdogs import Inside, WatchdogConfigError, WatchdogSettings, Where

log = logging.getLogger("lockstep.rank.boot")


def wait_for(rt: RankRuntime, io: RankIO, kind: type | tuple[type, ...], stash: list[object],
             what: str):
    """Block on the inbox until an event of `kind`; keep the rest for the serve loop.
    SHUTDOWN or a signal before serving ends the rank cleanly; a watchdog's verdict
    (launcher gone, peer lost) ends it with the watchdog's phase."""
    for i, e in enumerate(stash):
        if isinstance(e, kind):
            return stash.pop(i)
    while True:
        e = io.inbox.get()
        if isinstance(e, kind):
            return e
        if isinstance(e, ev.ShutdownEv | ev.SignalEv):
            if isinstance(e, ev.SignalEv):
                rt.seams.on_signal(f"signal {e.signum} while waiting for {what}")
            rt.exit(EXIT_OK, Phase.EXITING, None)
        if isinstance(e, ev.ExitEv):
            rt.exit(e.code, e.phase, f"{e.reason} (while waiting for {what})")
        if isinstance(e, ev.IoFailed):
            rt.exit(EXIT_FAILED, Phase.FAILED, e.error)
        stash.append(e)  # for a later wait, or the serve loop


def init_distributed(spec: RankSpec):
    if spec.world_size == 1:
        return None
    if spec.backend not in (Backend.RING, Backend.JACCL, Backend.MPI):
        raise StartupError(f"backend {spec.backend.value!r} cannot run {spec.world_size} ranks")
    group = mx.distributed.init(strict=True, backend=spec.backend.value)
    if group.size() != spec.world_size or group.rank() != spec.rank:
        raise StartupError(f"distributed group is rank {group.rank()} of {group.size()}, the "
                           f"spec says rank {spec.rank} of {spec.world_size} (check MLX_RANK "
                           "and the hostfile)")
    return group


def load_shard(spec: RankSpec, group) -> tuple[object, object, list[int], int, int | None]:
    """(model, tokenizer, eos token ids, vocab size, context length or None) for this
    rank's shard; the tokenizer is kept for constrained decoding (services/rank/grammar.py)."""
    path = spec.model_path
    if group is None:
        from mlx_lm import load

        model, tokenizer, config = load(path, return_config=True)
    else:
        from mlx_lm.utils import sharded_load

        if spec.tp == spec.world_size and spec.pp == 1:
            kw = {"tensor_group": group}
        elif spec.pp == spec.world_size and spec.tp == 1:
            kw = {"pipeline_group": group}
        else:
            raise StartupError(f"tp={spec.tp} pp={spec.pp} over {spec.world_size} ranks is not "
                               "supported (use tp=N or pp=N)")
        model, tokenizer, config = sharded_load(path, return_config=True, **kw)
    ctx = config.get("max_position_embeddings")
    return model, tokenizer, sorted(tokenizer.eos_token_ids), int(config["vocab_size"]), \
        int(ctx) if isinstance(ctx, int) and ctx > 0 else None


def kv_budget_of(settings: RankSettings, warm: WarmReport) -> KvBudget | None:
    """The KV budget rank 0 enforces (None: none set); a budget on a cache that
    services/rank/kv_budget.py cannot count is logged and not enforced (status shows
    slot bytes 0)."""
    if not settings.kv_budget_bytes:
        return None
    if not warm.kv_slot_bytes:
        log.error("KV budget of %d bytes NOT enforced: %s", settings.kv_budget_bytes,
                  warm.kv_layout)
        return None
    kv = KvBudget(settings.kv_budget_bytes, warm.kv_slot_bytes)
    log.info("KV budget: %d bytes per rank, %d bytes per token slot, %d slots of growth",
             kv.budget, kv.slot, kv.slack)
    return kv


def run(spec: RankSpec) -> None:
    rt = RankRuntime(spec)
    rt.set_phase(Phase.STARTING)
    try:
        rt.timeouts = WatchdogSettings.resolve(spec.settings, os.environ)  # env beats spec
        keys = LaunchKeys(read_secret_file(Path(spec.secret_path)), spec.deployment_id,
                          spec.job_id)
        io = RankIO(spec, keys, rt)
        rt.attach_io(io)
    except (WatchdogConfigError, KeyFileError, OSError) as exc:
        rt.exit(EXIT_FAILED, Phase.FAILED, f"cannot start: {exc}")
    except Exception as exc:  # noqa: BLE001 - zmq bind errors and the like
        rt.exit(EXIT_FAILED, Phase.FAILED, f"cannot open the bus: {exc}")
    rt.install_signal_handlers(io.signal_fd)
    io.start()
    Watchdogs(RankSide(rt, io), rt.timeouts, launcher=rt.launcher).start()
    removals = RemovalLog(removals_path(rt.paths, spec.deployment_id, spec.rank))
    stash: list[object] = []

    lease = wait_for(rt, io, ev.LeaseSeen, stash, "a LEASE on control").lease
    if lease.cancel_epoch > rt.cancel_floor:  # present at start-up: a watermark
        rt.cancel_floor = rt.cancel_epoch = lease.cancel_epoch
    rt.set_phase(Phase.LOADING)
    try:
        rt.inside = Where(Inside.DISTRIBUTED_INIT)  # a peer that never starts: forever
        group = init_distributed(spec)
        rt.inside = Where(Inside.LOAD)
        model, tokenizer, eos_ids, vocab, max_context = load_shard(spec, group)
        determinism = Determinism.OFF
        if spec.settings.deterministic:  # before the warm-up: it runs the same path
            from services.rank.determinism import install

            invariance = install(model)  # NotInvariant: refused, as a failed load
            determinism = invariance.mode
            log.info("%s", invariance.line())
        disk, verified, wanted = open_disk_tier(spec)  # every file's MAC checked
        if disk is not None:
            rt.disk_tier = disk
            rt.on_exit(lambda _reason: disk.close(DISK_FLUSH_S))  # pending writes land
        engine = Engine(model, eos_ids, spec.settings,
                        grammars=RankGrammars(tokenizer, eos_ids, vocab),  # built lazily
                        disk=disk, verified=verified)
        if not rt.leader and wanted:
            rt.disk_report = boot_report(spec.rank, verified, off=disk is None)
        rt.inside = Where(Inside.WARM_UP)  # with every peer: a lost one blocks it
        warm = warm_up(model, engine, spec.settings, vocab)
        log.info("%s", warm.line())
        kv = kv_budget_of(spec.settings, warm)
        rt.kv = KvStats(budget=kv.budget if kv else 0, slot_bytes=warm.kv_slot_bytes)
    except Exception as exc:  # noqa: BLE001 - any load failure ends this rank, reported
        log.exception("loading or the warm-up failed")
        rt.exit(EXIT_FAILED, Phase.FAILED, f"load failed: {exc}")
    finally:
        rt.inside = None

    next_seq = 0
    if spec.world_size > 1:
        next_seq = wait_for(rt, io, ev.Joined, stash, "the plan session").next_seq
    rt.set_phase(Phase.READY)
    endpoints = {"plan": spec.plan_endpoint, "requests": spec.requests_endpoint} \
        if rt.leader else {}
    io.post(AnnounceReady(RankReady(
        deployment_id=spec.deployment_id, job_id=spec.job_id, rank=spec.rank,
        host=spec.host or socket.gethostname(), pid=rt.pid, start_time=rt.start_time,
        boot_id=rt.boot_id, endpoints=endpoints, determinism=determinism,
        speculation=spec.settings.speculative if rt.leader else Speculation.OFF)))
    # Rank 0 plans only once it was released, so a plan is a release too (a follower
    # that missed SERVE on the PUB must not leave rank 0 alone in a collective).
    got = wait_for(rt, io, (ev.ServeEv, ev.PlanEv), stash, "SERVE")
    if isinstance(got, ev.PlanEv):
        stash.insert(0, got)
    io.post(Served())
    rt.set_phase(Phase.SERVING)

    try:
        if rt.leader:
            from services.rank.leader import Leader

            Leader(rt, io, engine, removals, stash, vocab_size=vocab,
                   context=max_context, kv=kv).run()
        else:
            from services.rank.follower import Follower

            Follower(rt, io, engine, removals, stash, next_seq=next_seq).run()
    except Exception as exc:  # noqa: BLE001 - a bug must still end in a marker, not a hang
        log.exception("rank loop failed")
        rt.exit(EXIT_FAILED, Phase.FAILED, f"internal error: {exc!r}")
