"""`lockstep admin COMMAND` — the supervisor's signed ZeroMQ admin socket from the shell.

    lockstep admin [--home DIR] [--endpoint EP] [--timeout S] [--json] COMMAND ...
      ping | status | watch | deployments | reap
      deploy [--model PATH] [--tp N] [--pp N] [--replicas N] [--hosts FILE] [--backend B] [--id ID]
             [--no-wait]
      stop ID [--force]
      cancel ID [--scope all|requests] [--request-id RID ...] [--reason TEXT]
      abort-all [ID] [--timeout-s S]
      cache-clear ID [--timeout-s S]
      backend-selection --hosts FILE [--backend B]
      replan ID --backend B [--signature SIG] [--force]

The endpoint comes from `$LOCKSTEP_HOME/runtime/supervisor.json` unless given. Exit
status: 0 ok, 1 the supervisor answered with an error (its code is printed), 2 usage,
3 no answer (supervisor not running, or the deadline passed). `--json` prints the whole
reply `{ok, code, message, data}`. `watch` redraws `status` every second in place
(services/admin/status.py) until Ctrl-C (exit 0).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from common.atomic_json import StateFileError
from common.bus import BusTimeout, Channel, new_request_id
from common.deployment_info import DeploymentInfoError, read_deployment_info
from common.envelope import Key
from common.home import Paths, default_home, read_supervisor_record
from common.keys import KeyFileError, load_cluster_key
from common.messages import ADMIN_OUT, AdminReply, AdminRequest, CacheStats
from common.rpc_client import SyncRpcClient
from common.sampling_defaults import FIELDS as SAMPLING_FIELDS
from services.admin import status as admin_status

LONG_COMMANDS = {"deploy": 900.0, "stop": 120.0, "replan": 900.0, "abort_all": 120.0,
                 "cancel": 60.0, "reap": 120.0, "cache_clear": 620.0}


class AdminClient:
    """Blocking admin client (CLI, tests, scripts): one DEALER, calls with deadlines."""

    def __init__(self, endpoint: str, key: Key, *, ctx: zmq.Context | None = None) -> None:
        self._own = ctx is None
        self.ctx = ctx or zmq.Context()
        self.channel = Channel("admin_cli", "admin", sender=f"admin-cli:{new_request_id()}",
                               send_key=key, accept=ADMIN_OUT)
        self.rpc = SyncRpcClient(self.ctx, endpoint, self.channel)

    @classmethod
    def from_home(cls, home: Path, endpoint: str | None = None) -> AdminClient:
        key = load_cluster_key(Path(home) / "keys" / "cluster.key")
        return cls(endpoint or supervisor_endpoint(Path(home)), key)

    def call(self, command: str, timeout: float | None = None, **args: Any) -> AdminReply:
        req = AdminRequest(request_id=new_request_id(), command=command, args=args)
        msg = self.rpc.call(req, timeout if timeout is not None else LONG_COMMANDS.get(command, 15.0))
        return msg.body

    def close(self) -> None:
        self.rpc.close()
        if self._own:
            self.ctx.term()


def supervisor_endpoint(home: Path) -> str:
    try:
        return read_supervisor_record(Paths(home).supervisor_file).admin
    except StateFileError as exc:
        raise SystemExit(f"lockstep admin: no supervisor found under {home} ({exc}); "
                         "start one with `lockstep supervisor` or pass --endpoint") from None


def _hosts_args(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    from services.supervisor.hosts import HostsError, read_hosts_file

    try:
        doc = read_hosts_file(Path(path))
    except HostsError as exc:
        raise SystemExit(f"lockstep admin: {exc}") from None
    out: dict[str, Any] = {"hosts": doc.hosts}
    if doc.envs:
        out["envs"] = doc.envs
    if doc.backend:
        out["backend"] = doc.backend
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lockstep admin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # The common options work before or after the command (`admin status --json`); the
    # subcommand copies default to SUPPRESS so they never overwrite one given before.
    common = argparse.ArgumentParser(add_help=False)
    for parser, default in ((ap, None), (common, argparse.SUPPRESS)):
        parser.add_argument("--home", type=Path, default=default)
        parser.add_argument("--endpoint", default=default)
        parser.add_argument("--timeout", type=float, default=default,
                            help="seconds to wait for a reply")
        parser.add_argument("--json", action="store_true",
                            default=False if default is None else default,
                            help="print the whole reply as JSON")
    sub = ap.add_subparsers(dest="command", required=True)

    def add(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common])

    for name in ("ping", "status", "watch", "deployments", "reap"):
        add(name)
    p = add("deploy")
    p.add_argument("--model", dest="model_path")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--hosts")
    p.add_argument("--backend", choices=("auto", "ring", "jaccl", "mpi"))
    p.add_argument("--id", dest="deployment_id")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--no-wait", dest="wait", action="store_false")
    for flag, tp in (("--temperature", float), ("--top-p", float), ("--top-k", int),
                     ("--min-p", float), ("--repetition-penalty", float)):
        p.add_argument(flag, type=tp)  # sampling defaults for requests that name none
    p = add("stop")
    p.add_argument("deployment_id")
    p.add_argument("--force", action="store_true")
    p = add("cancel")
    p.add_argument("deployment_id")
    p.add_argument("--scope", choices=("all", "requests"), default="requests")
    p.add_argument("--request-id", dest="request_ids", action="append", default=[])
    p.add_argument("--reason", default="")
    p = add("abort-all")
    p.add_argument("deployment_id", nargs="?")
    p.add_argument("--timeout-s", type=float, default=None)
    p = add("cache-clear")
    p.add_argument("deployment_id")
    p.add_argument("--timeout-s", type=float, default=None)
    p = add("backend-selection")
    p.add_argument("--hosts", required=True)
    p.add_argument("--backend", choices=("auto", "ring", "jaccl", "mpi"), default=None)
    p = add("replan")
    p.add_argument("deployment_id")
    p.add_argument("--backend", choices=("auto", "ring", "jaccl", "mpi"), required=True)
    p.add_argument("--signature")
    p.add_argument("--force", action="store_true")
    return ap


def build_request(ns: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    cmd = ns.command.replace("-", "_")
    a: dict[str, Any] = {}
    if cmd == "deploy":
        a = {"model_path": ns.model_path, "tp": ns.tp, "pp": ns.pp,
             "deployment_id": ns.deployment_id, "wait": ns.wait, "replicas": ns.replicas,
             **_hosts_args(ns.hosts)}
        if ns.backend:
            a["backend"] = ns.backend
        given = {k: getattr(ns, k) for k in SAMPLING_FIELDS if getattr(ns, k) is not None}
        if given:
            a["sampling"] = given
    elif cmd == "stop":
        a = {"deployment_id": ns.deployment_id, "force": ns.force}
    elif cmd == "cancel":
        a = {"deployment_id": ns.deployment_id, "scope": ns.scope,
             "request_ids": ns.request_ids, "reason": ns.reason}
    elif cmd in ("abort_all", "cache_clear"):
        a = {"deployment_id": ns.deployment_id, "timeout_s": ns.timeout_s}
    elif cmd == "backend_selection":
        a = _hosts_args(ns.hosts)
        a.pop("envs", None)
        if ns.backend:
            a["backend"] = ns.backend
    elif cmd == "replan":
        a = {"deployment_id": ns.deployment_id, "backend": ns.backend,
             "signature": ns.signature, "force": ns.force}
    return cmd, a


def human(cmd: str, data: dict[str, Any]) -> str:
    if cmd == "status":
        return admin_status.render(data)
    if cmd == "deployments":
        lines = []
        for d in map(read_deployment_info, data["deployments"]):
            lines.append(f"{d.deployment_id}  {d.state:<15} {d.model} tp={d.tp} "
                         f"pp={d.pp} backend={d.backend} job={d.job_id}"
                         + (f"  error: {d.error}" if d.error else ""))
            for r in d.ranks:
                lines.append(f"    rank {r.rank} pid {r.pid:<7} {r.phase:<10} "
                             f"step {r.step:<6} active {r.active:<3} "
                             f"acked epoch {r.acked_epoch}" + _cache_text(r.cache))
        if not data["deployments"]:
            lines.append("no deployments")
        return "\n".join(lines)
    if cmd == "stop":
        o = data["outcome"]
        return (f"stopped {data['deployment_id']}: {' -> '.join(o.get('path') or ['none alive'])} "
                f"in {o.get('duration_s', 0):.2f}s, every rank's exit proven")
    if cmd == "abort_all":
        return (f"epoch {data['epoch']}: zero active {data['zero_active']}; ranks "
                f"{data['ranks']}; missing acks {data['missing']}")
    if cmd == "cache_clear":
        if not data["enabled"]:
            return f"{data['deployment_id']}: the prefix cache is off, nothing to clear"
        return (f"{data['deployment_id']}: every rank's prefix cache emptied at step "
                f"{data['step']} (clear {data['clear_id']}, {data['sends']} sends)")
    if cmd == "backend_selection":
        lines = [f"backend {data['backend']} ({len(data['members'])} members)"]
        lines += [f"  blocker {b['member']}: {b['reason']}" for b in data["blockers"]]
        return "\n".join(lines)
    if cmd == "ping":
        return f"supervisor pid {data['pid']} (boot {data['boot_id']}, version {data['version']})"
    if cmd == "deploy" or (cmd == "replan" and not data.get("preview")):
        return f"{data['deployment_id']}: {data['state']} (job {data['job_id']})"
    if cmd == "replan":
        return (f"preview: {json.dumps(data['current'], sort_keys=True)} -> "
                f"{json.dumps(data['plan'], sort_keys=True)}\n"
                f"apply with: --signature {data['signature']}")
    if cmd == "cancel":
        return (f"epoch {data['epoch']}: acked by ranks {sorted(data['acked'])}; missing "
                f"{data['missing']}; dead {data['dead']} ({data['sends']} sends)")
    if cmd == "reap":
        lines = [f"reaped {data['reaped'] or 'none'}; active {data['active'] or 'none'}"]
        lines += [f"  FAILED {f['job_id']}: {f['reason']}" for f in data.get("failures") or []]
        lines += [f"  UNREADABLE {u['path']}: {u['error']}" for u in data.get("unreadable") or []]
        return "\n".join(lines)
    return json.dumps(data, indent=2, sort_keys=True)


def _cache_text(c: CacheStats | None) -> str:
    if c is None:  # off, or no telemetry with it yet
        return "  cache -"
    return f"  cache {c.entries} entries {c.tokens} tokens {c.bytes / 2**20:.1f} MiB"


def watch(client: AdminClient, timeout: float | None, period_s: float = 1.0) -> int:
    """`status`, redrawn in place every `period_s` until Ctrl-C (exit 0)."""
    prev = None
    # Ctrl-C is ours, explicitly: Python installs its KeyboardInterrupt handler only when
    # SIGINT did not arrive ignored, and a shell's background job inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            t0 = time.monotonic()
            try:
                reply = client.call("status", timeout or 5.0)
                if reply.ok:
                    text = admin_status.render(reply.data, prev=prev)
                    prev = admin_status.steps_of(reply.data)
                else:
                    text = f"error [{reply.code}]: {reply.message}"
            except BusTimeout as exc:
                text = f"lockstep admin watch: no answer: {exc}"
            except DeploymentInfoError as exc:
                text = f"lockstep admin watch: {exc}"
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{admin_status.CLEAR}lockstep admin watch  {stamp}  "
                             f"(every {period_s:g}s, Ctrl-C to quit)\n\n{text}\n")
            sys.stdout.flush()
            time.sleep(max(0.0, period_s - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    home = (ns.home or default_home()).expanduser()
    cmd, args = build_request(ns)
    try:
        client = AdminClient.from_home(home, ns.endpoint)
    except KeyFileError as exc:
        print(f"lockstep admin: {exc}", file=sys.stderr)
        return 2
    if cmd == "watch":
        return watch(client, ns.timeout)
    try:
        reply = client.call(cmd, ns.timeout, **args)
    except BusTimeout as exc:
        print(f"lockstep admin: {exc}", file=sys.stderr)
        return 3
    finally:
        client.close()
    if ns.json:
        print(json.dumps({"ok": reply.ok, "code": reply.code, "message": reply.message,
                          "data": reply.data}, indent=2, sort_keys=True, default=str))
    elif reply.ok:
        try:
            print(human(cmd, reply.data))
        except DeploymentInfoError as exc:  # not what the supervisor writes: say so
            print(f"lockstep admin: {exc} (see --json)", file=sys.stderr)
            return 1
    else:
        print(f"error [{reply.code}]: {reply.message}", file=sys.stderr)
    return 0 if reply.ok else 1


if __name__ == "__main__":
    sys.exit(main())
