"""`lockstep supervisor [--home DIR] [--admin-port N] ... ` — run the supervisor.

Every setting (settings.py) is a flag (`--load-timeout 60`) and an environment variable
(`LOCKSTEP_LOAD_TIMEOUT=60`). The bound endpoints are printed and written to
`$LOCKSTEP_HOME/runtime/supervisor.json` (0600). SIGTERM/SIGINT take the same path as a
stop of every deployment: verified teardown, then exit. Started by `lockstep up`, it
takes the same path when `up` is gone (common/launcher_watch.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import types
import typing
from pathlib import Path

import zmq

from common.config import ConfigError
from common.keys import KeyFileError
from common.launcher_watch import watch_launcher
from services.supervisor.homelock import SupervisorBusy
from services.supervisor.hosts import HostsError
from services.supervisor.settings import SupervisorSettings, load


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lockstep supervisor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(SupervisorSettings)
    for f in dataclasses.fields(SupervisorSettings):
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Optional[X] → X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            ap.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            ap.add_argument(flag, dest=f.name, type=Path if tp is Path else tp, default=None)
    ap.add_argument("--log-level", default="INFO")
    return ap


async def _run(settings: SupervisorSettings) -> int:
    from services.supervisor.service import Supervisor

    sup = Supervisor(settings)
    loop = asyncio.get_running_loop()
    asked: list[signal.Signals] = []
    started = asyncio.Event()

    async def stop() -> None:
        await started.wait()  # a signal during start (its reap) stops it once it is up
        await sup.close()

    def quit_(sig: signal.Signals) -> None:  # only schedules work, on the loop
        if not asked:
            asked.append(sig)
            logging.getLogger("lockstep.supervisor").info(
                "%s: stopping, verified teardown of every deployment", sig.name)
            sup.spawn(stop())

    # Before start: runtime/supervisor.json appears during it, and a SIGTERM from whoever
    # reads it must take the orderly path, not the default death.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, quit_, sig)
    await sup.start()
    started.set()
    sk = sup.sockets
    print(json.dumps({"pid": sup.me.pid, "admin": sk.admin_endpoint, "events": sk.events_endpoint,
                      "control": sk.control_endpoint, "report": sk.report_endpoint}), flush=True)
    watch_launcher("supervisor")  # `lockstep up` gone → SIGTERM → the stop above
    await sup.wait_closed()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    logging.basicConfig(level=args.pop("log_level").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = load(args)
        return asyncio.run(_run(settings))
    except (ConfigError, KeyFileError, HostsError, SupervisorBusy) as exc:
        print(f"lockstep supervisor: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:  # a port taken by another program (or supervisor)
        print(f"lockstep supervisor: cannot bind its sockets: {exc}; choose other ports "
              "(--admin-port, --events-port, --control-port, --report-port)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
