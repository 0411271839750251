"""`lockstep gateway [--home DIR] [--host H] [--port P] ...` — the OpenAI-compatible
HTTP gateway (settings: services/gateway/core/settings.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from common.config import ConfigError
from common.keys import KeyFileError, load_cluster_key
from common.launcher_watch import watch_launcher
from services.gateway.core import settings as gw_settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lockstep gateway", description=__doc__)
    ap.add_argument("--home", type=Path)
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--admin-endpoint", dest="admin_endpoint")
    ap.add_argument("--events-endpoint", dest="events_endpoint")
    ap.add_argument("--reaper-events-endpoint", dest="reaper_events_endpoint")
    ap.add_argument("--request-read-timeout", dest="request_read_timeout", type=float)
    ap.add_argument("--log-level", dest="log_level")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        s = gw_settings.load({k: v for k, v in vars(args).items() if v is not None})
    except (ConfigError, TypeError) as exc:
        print(f"lockstep gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=s.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        key = load_cluster_key(s.cluster_key_path)
    except KeyFileError as exc:  # fail closed: no key, no service
        print(f"lockstep gateway: {exc}", file=sys.stderr)
        return 1
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.server import GatewayServer

    where = "loopback only" if s.host in ("127.0.0.1", "localhost", "::1") else "ALL listed interfaces"
    print(f"lockstep gateway: binding {s.host}:{s.port} ({where}; --host / LOCKSTEP_HOST to change)",
          flush=True)
    if not s.resolved_admin_token():
        print("lockstep gateway: no admin token configured: the admin API is closed", flush=True)
    app = create_app(s, key)
    server = GatewayServer(app, uvicorn.Config(app, host=s.host, port=s.port,
                                               log_level=s.log_level.lower(), access_log=False,
                                               timeout_graceful_shutdown=5))
    # uvicorn re-raises the signal that stopped it once it has shut down; with a Python
    # handler in place that is a no-op, and a SIGTERM/SIGINT stop exits 0 (clean).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        watch_launcher("gateway")  # `lockstep up` gone → SIGTERM → uvicorn's shutdown
    except ConfigError as exc:
        print(f"lockstep gateway: {exc}", file=sys.stderr)
        return 2
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
