"""`lockstep up` — serve a model on this machine with one command.

    lockstep up [--port 8000] [--home ~/.lockstep] [--model PATH] [--tp 2] [--pp 1]
                [--replicas 1] [--hosts FILE] [--backend auto|ring|jaccl|mpi] [--host 127.0.0.1]
                [--prompt-cache-entries 32] [--prompt-cache-bytes 0]
                [--prompt-cache-disk-bytes -1] [--kv-budget-bytes -1] [--prefill-stall-ratio 3]
                [--prefill-long-prompt 2048] [--temperature T] [--top-p P] ...
                [--no-deterministic] [--speculative off|ngram]

Starts `lockstep supervisor`, `lockstep reaper` and `lockstep gateway` as separate
processes (each in its own session, logs in $LOCKSTEP_HOME/runtime/logs/), writes the
cluster key and the admin token (0600) on first run, builds the default model once (no
--model: SmolLM2-135M-Instruct, served PP=2; services/up/model.py), deploys it (TP=2 by
default for any other model; what the user names wins, services/up/model.py), waits for
/ready and prints the URL with a curl to paste. A tp/pp the model cannot be split into is
refused before anything starts (services/supervisor/topology.py). --temperature, --top-p,
...: one flag per sampling parameter a deployment may default (common/request_params.py
`deployable`): what a request that does not name it is sampled with (over the model's
generation_config.json; common/sampling_defaults.py).
--no-deterministic: mlx-lm's own forward pass instead of the batch-invariant one
(faster; a request's output may then depend on what shares its batch; README
"Determinism"). If the deployment fails on its own (a rank died, a peer was lost) it is
torn down with proof and redeployed, at most --restarts times (default 3) within any
--restart-window seconds (default 600), spaced by a doubling --restart-backoff (default
2 s; services/up/restart_budget.py). Past that rate `up` keeps serving nothing but stays
up (gateway, supervisor, reaper running; /ready 503) until a deployment of the model is
deployed again (`lockstep admin deploy`), which it then watches as its own.
A supervisor that dies (SIGKILL, a crash) is restarted on the same ports, at most
--supervisor-restarts times (default 3) within --restart-window, and adopts the ranks it
left serving: the gateway's streams go on (services/up/supervisor_keeper.py; each local
rank waits --adopt-window seconds, default 30, for that; 0 = ranks end with their
supervisor). With --supervisor-restarts 0 the gateway and reaper keep running, the ranks
end on their own and `up` waits for Ctrl-C.
--replicas N: N deployments of the model behind the one gateway, each on the next tp×pp
rank slots of --hosts (services/up/replicas.py); a failed one is redeployed while the
others serve, and the gateway resumes its requests on them at once.
Ctrl-C / SIGTERM / SIGHUP (a closed terminal; also a hung-up terminal whose SIGHUP went
only to a session leader that kept it, as `make` does: services/up/terminal.py): abort_all, verified teardown of every
deployment, then SIGTERM → SIGKILL each service; exit 0 only when every process it
started (and every rank) is proven gone. Messages also go to runtime/logs/up.log, and a
stop never needs a writable stdout (services/up/console.py). Each service watches `up`
(common/launcher_watch.py: parent death + a lease on its identity) and stops in order on
its own when `up` is gone, even SIGKILLed.

Settings: CLI > LOCKSTEP_<NAME> > defaults; ports: --admin-port 7710, --events-port 7711,
--control-port 7712, --report-port 7713, --reaper-events-port 7714 (0 = any free port).
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path

from common.bus import BusInterrupted, BusTimeout
from common.config import ConfigError, load_settings
from common.keys import KeyFileError
from common.rankspec import speculation_problem
from common.request_params import deployable
from common.sampling_defaults import check_overrides
from services.up.admin import UpError
from services.up.run import Up
from services.up.settings import UpSettings, named_sampling
from services.up.terminal import watch_terminal


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lockstep up", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("auto", "ring", "jaccl", "mpi"), default=None)
    for flag, tp in (("--home", Path), ("--host", str), ("--port", int), ("--model", str),
                     ("--tp", int), ("--pp", int), ("--hosts", Path),
                     ("--admin-port", int), ("--events-port", int), ("--control-port", int),
                     ("--report-port", int), ("--reaper-events-port", int),
                     ("--ready-timeout", float), ("--stop-timeout", float),
                     ("--restarts", int), ("--restart-window", float),
                     ("--restart-backoff", float), ("--replicas", int),
                     ("--supervisor-restarts", int), ("--adopt-window", float),
                     ("--prompt-cache-entries", int),
                     ("--prompt-cache-bytes", int), ("--prompt-cache-disk-bytes", int),
                     ("--kv-budget-bytes", int),
                     ("--prefill-stall-ratio", float),
                     ("--prefill-long-prompt", int), ("--speculative", str),
                     *((p.flag, p.kind) for p in deployable())):
        ap.add_argument(flag, type=tp, default=None)
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(sys.argv[1:] if argv is None else argv))
    try:
        s = load_settings(UpSettings, args)
        if bad := check_overrides(named_sampling(s)):
            raise ConfigError("; ".join(bad))
        if why := speculation_problem(s.speculative, s.deterministic):
            raise ConfigError(why)
    except (ConfigError, TypeError) as exc:
        print(f"lockstep up: {exc}", file=sys.stderr)
        return 2
    try:
        up = Up(s)
        up.preflight()  # nothing started yet: nothing to stop if it fails
    except OSError as exc:
        print(f"lockstep up: cannot use home {s.home}: {exc}", file=sys.stderr)
        return 2
    except UpError as exc:
        print(f"lockstep up: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum, frame) -> None:  # only sets a flag: the main loop does the work
        up.stop_flag.set()  # a second Ctrl-C changes nothing: the stop runs to its end

    # SIGHUP is a closed terminal: the same orderly stop. SIGPIPE stays ignored (Python's
    # default), so a dead pipe is an error UpConsole swallows, never a death mid-stop.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    watch_terminal(up.stop_flag.set)  # a hang-up whose SIGHUP went elsewhere: the same stop
    code = 0
    try:
        code = up.run()
    except BusInterrupted:  # a stop request cut a wait short (e.g. a redeploy's stop)
        code = 0
    except (UpError, BusTimeout, KeyFileError, OSError, ValueError) as exc:  # then shutdown
        up.log(str(exc), err=True)
        code = 1
    except Exception as exc:  # noqa: BLE001 - a bug here must still stop everything in order
        up.log(f"internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}", err=True)
        code = 1
    if not up.procs:  # refused before anything started (a bad topology, a busy port...)
        return code
    up.log("stopping: abort_all, verified teardown, services")
    if not up.shutdown():
        up.log("shutdown NOT verified (see above)", err=True)
        return 1
    up.log("every process stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
