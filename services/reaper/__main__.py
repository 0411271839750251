"""`lockstep reaper` — reap orphaned launches, periodically or once.

    lockstep reaper [--home DIR] [--interval S] [--term-timeout S] [--kill-timeout S]
                    [--events-port P] [--events-host H] [--ssh-config FILE]
    lockstep reaper --once [--json]

The service runs one pass (see `services.reaper.reap`) every `--interval` seconds
(default 10), logs each pass, and with `--events-port` publishes it as signed
`Event(topic="reap")`s on its own events PUB (cluster key, topic frame b"events").
SIGTERM/SIGINT end it cleanly after the pass in progress: the handlers only set a flag
(and wake the sleep through a wakeup fd). Started by `lockstep up`, it stops the same
way when `up` is gone (common/launcher_watch.py).

`--once` does one pass and prints it (`--json`: the report as JSON). Exit status: 0 for
a clean pass, 1 if a reap failed or a manifest is unreadable (launches are blocked),
2 for bad usage or configuration.

Settings: CLI > environment > defaults (`ReaperSettings`):
  LOCKSTEP_HOME, LOCKSTEP_REAPER_INTERVAL, LOCKSTEP_REAPER_TERM_TIMEOUT,
  LOCKSTEP_REAPER_KILL_TIMEOUT, LOCKSTEP_REAPER_EVENTS_PORT, LOCKSTEP_REAPER_EVENTS_HOST,
  LOCKSTEP_SSH_CONFIG, LOCKSTEP_SSH_CONNECT_TIMEOUT, LOCKSTEP_SSH_COMMAND_TIMEOUT.

Ranks on remote hosts (`RankRecord.remote`) are reaped over ssh through the host agent
(`services.reaper.remote`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from common.config import ConfigError, Port, PositiveSeconds, load_settings
from common.home import Paths, default_home
from common.keys import KeyFileError, load_cluster_key
from common.launcher_watch import watch_launcher
from common.zmtp_watch import ZmtpWatch
from services.reaper.adoption_window import AdoptionWindow
from services.reaper.events import EventPublisher
from services.reaper.reap import Publish, ReapReport, reap_orphans
from services.reaper.remote import SshRemoteReaper

log = logging.getLogger("lockstep.reaper")


@dataclass(frozen=True)
class ReaperSettings:
    home: Path | None = None  # LOCKSTEP_HOME, default ~/.lockstep
    reaper_interval: PositiveSeconds = 10.0
    reaper_term_timeout: PositiveSeconds = 5.0
    reaper_kill_timeout: PositiveSeconds = 5.0
    reaper_events_port: Port | None = None  # None: no events PUB; 0: any free port
    reaper_events_host: str = "127.0.0.1"
    ssh_config: str = ""  # for remote ranks whose record names no ssh client config
    ssh_connect_timeout: PositiveSeconds = 5.0
    ssh_command_timeout: PositiveSeconds = 30.0


class _StopFlag:
    """Set by SIGTERM/SIGINT; `sleep` wakes at once through the signal wakeup fd."""

    def __init__(self) -> None:
        self.stop = False
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum: int, frame: object) -> None:
        self.stop = True

    def sleep(self, seconds: float, watch: ZmtpWatch | None = None) -> None:
        """Wait `seconds` (or until a signal), feeding `watch` its monitor events."""
        poller = zmq.Poller()
        poller.register(self._r.fileno(), zmq.POLLIN)
        if watch is not None:
            poller.register(watch.monitor, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        due = math.inf  # the watch's next tick (silent closes, memory)
        while not self.stop and (left := deadline - time.monotonic()) > 0:
            wait = min(left, max(0.0, due - time.monotonic()))
            ready = dict(poller.poll(int(wait * 1000) + 1))
            if watch is not None:
                if watch.monitor in ready:
                    watch.drain()
                due = watch.tick(time.monotonic())
            if self._r.fileno() in ready:
                break
        try:
            while self._r.recv(64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_fd)
        self._r.close()
        self._w.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lockstep reaper",
                                 description="Reap orphaned launches and stale markers.")
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--interval", type=float, default=None, help="seconds between passes")
    ap.add_argument("--term-timeout", type=float, default=None)
    ap.add_argument("--kill-timeout", type=float, default=None)
    ap.add_argument("--events-port", type=int, default=None)
    ap.add_argument("--events-host", default=None)
    ap.add_argument("--ssh-config", default=None,
                    help="ssh client config for remote ranks whose record names none")
    ap.add_argument("--once", action="store_true", help="one pass, then exit")
    ap.add_argument("--json", action="store_true", help="with --once: print the report as JSON")
    return ap.parse_args(argv)


def _print_report(report: ReapReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_dict(), indent=1, sort_keys=True))
        return
    print(f"reap: {report.summary()}")
    for f in report.failures:
        print(f"  FAILED {f['job_id']}: {f['reason']}")
    for u in report.unreadable:
        print(f"  UNREADABLE {u['path']}: {u['error']}")


def _run_pass(paths: Paths, s: ReaperSettings, publish: Publish | None,
              window: AdoptionWindow | None = None) -> ReapReport:
    remote = SshRemoteReaper(paths, ssh_config=s.ssh_config,
                             connect_timeout=s.ssh_connect_timeout,
                             command_timeout=s.ssh_command_timeout)
    report = reap_orphans(paths, term_timeout=s.reaper_term_timeout,
                          kill_timeout=s.reaper_kill_timeout, remote=remote, publish=publish,
                          window=window)
    level = logging.WARNING if report.blocking else logging.INFO
    log.log(level, "reap pass: %s", report.summary())
    if report.blocking:
        log.warning("launches blocked:\n%s", report.blockers())
    return report


def _serve(paths: Paths, s: ReaperSettings) -> int:
    publisher = None
    if s.reaper_events_port is not None:
        try:
            key = load_cluster_key(paths.cluster_key)
        except KeyFileError as exc:  # fail closed: no key, no events service
            log.error("%s", exc)
            return 2
        publisher = EventPublisher(key, s.reaper_events_host, s.reaper_events_port)
        log.info("events PUB on %s", publisher.endpoint)
    flag = _StopFlag()
    try:
        watch_launcher("reaper")  # `lockstep up` gone → SIGTERM → the flag
    except ConfigError as exc:
        flag.close()
        if publisher is not None:
            publisher.close()
        print(f"lockstep reaper: {exc}", file=sys.stderr)
        return 2
    log.info("reaper started (home %s, every %.1fs)", paths.home, s.reaper_interval)
    window = AdoptionWindow({})  # when each orphan was first seen, across passes
    try:
        while not flag.stop:
            _run_pass(paths, s, publisher.publish if publisher else None, window)
            if publisher is not None:
                publisher.publish_rejections()
            flag.sleep(s.reaper_interval, publisher.watch if publisher else None)
    finally:
        flag.close()
        if publisher is not None:
            publisher.close()
    log.info("reaper stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s reaper %(levelname)s %(message)s")
    try:
        s = load_settings(ReaperSettings, {
            "home": args.home, "reaper_interval": args.interval,
            "reaper_term_timeout": args.term_timeout, "reaper_kill_timeout": args.kill_timeout,
            "reaper_events_port": args.events_port, "reaper_events_host": args.events_host,
            "ssh_config": args.ssh_config})
    except ConfigError as exc:
        print(f"lockstep reaper: {exc}", file=sys.stderr)
        return 2
    paths = Paths(s.home.expanduser() if s.home else default_home())
    if args.once:
        report = _run_pass(paths, s, None)
        _print_report(report, args.json)
        return 1 if report.blocking else 0
    return _serve(paths, s)


if __name__ == "__main__":
    sys.exit(main())
