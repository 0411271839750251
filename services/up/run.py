"""`lockstep up`'s run: start the services, deploy, watch, and stop everything in order.

The command's flags and settings are in __main__.py and settings.py; this is what runs
once they are settled (see __main__.py's docstring for the whole story).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

from common.bus import BusTimeout
from common.home import Paths
from common.keys import KeyFileError, ensure_cluster_key
from common.launcher_watch import LAUNCHER_ENV, launcher_value
from common.messages import FAILED_STATES
from common.messages.commands import stop
from common.model_ref import model_id
from common.procs import ProcessIdentity, identify, is_alive, snapshot_children, terminate_ladder
from common.sampling_defaults import SamplingOverrides
from services.supervisor.hosts import HostsError, members_from_host_records, read_hosts_file
from services.supervisor.topology import TopologyError
from services.supervisor.topology import check as check_topology
from services.up.admin import AdminLink, DeploymentDown, UpError
from services.up.console import UpConsole
from services.up.preflight import busy_ports, supervisor_busy
from services.up.progress import UpProgress
from services.up.redeploy_notice import RedeployNotice
from services.up.restart_budget import RestartBudget
from services.up.settings import UpSettings, named_sampling
from services.up.single import SingleDeployment
from services.up.supervisor_keeper import SupervisorGone, SupervisorKeeper

RESTART_BACKOFF_MAX_S = 60.0  # the redeploy backoff doubles up to this
TEARDOWN_RETRY_S = 5.0  # an unproven teardown is retried after this, doubling ...
TEARDOWN_RETRY_MAX_S = 60.0  # ... up to this


def ensure_admin_token(path: Path) -> str:
    """The admin bearer token, created (0600) on first run."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    if path.stat().st_mode & 0o077:
        raise KeyFileError(f"{path} is readable by others; chmod 600 {path}")
    return path.read_text().strip()


class Up:
    def __init__(self, s: UpSettings) -> None:
        self.s = s
        self.paths = Paths(s.home).ensure()
        self.procs: dict[str, subprocess.Popen] = {}
        self.stop_flag = threading.Event()
        self.rank_pids: set[int] = set()
        # pid -> identity at first sight: by the final check a bare pid may be another
        # process's (pid_max wraps within minutes on a busy machine)
        self.rank_ids: dict[int, ProcessIdentity | None] = {}
        self.admin: AdminLink | None = None
        self.teardown_ok = True
        self.console = UpConsole(self.paths.logs / "up.log")
        self.shown = UpProgress(self.console, self.console.is_tty())  # stages while starting
        me = identify(os.getpid())
        self.launcher = launcher_value(me) if me is not None else None
        self.sampling = SamplingOverrides()  # what the deployment gets (model_path sets it)
        self.keeper = SupervisorKeeper(self)
        self.notice = RedeployNotice(self.paths)

    def log(self, msg: str, *, err: bool = False) -> None:
        """Never raises: the terminal may be gone (see console.py)."""
        self.shown.end()  # a stage's live line first gets its newline
        self.console.say(f"lockstep up: {msg}", err=err)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        # From the main thread only: a child's parent-death signal fires when the thread
        # that forked it exits, and ours lives as long as `up`.
        logf = open(self.paths.logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "services", name, "--home", str(self.paths.home), *argv]
        env = dict(os.environ)
        if self.launcher is not None:  # the child watches us by this (launcher_watch)
            env[LAUNCHER_ENV] = self.launcher
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True, env=env)
        logf.close()
        self.procs[name] = p
        self.log(f"started {name} (pid {p.pid}, log {self.paths.logs / (name + '.log')})")
        return p

    def start_supervisor(self, ports: dict[str, int]) -> subprocess.Popen:
        """The supervisor, on the settings' ports or (a restart) on `ports`, the ones the
        first one bound (services/up/supervisor_keeper.py)."""
        s = self.s
        port = {"admin": s.admin_port, "events": s.events_port, "control": s.control_port,
                "report": s.report_port, **ports}
        return self.spawn("supervisor", [
            "--admin-port", str(port["admin"]), "--events-port", str(port["events"]),
            "--control-port", str(port["control"]), "--report-port", str(port["report"]),
            "--prompt-cache-entries", str(s.prompt_cache_entries),
            "--prompt-cache-bytes", str(s.prompt_cache_bytes),
            "--prompt-cache-disk-bytes", str(s.prompt_cache_disk_bytes),
            "--kv-budget-bytes", str(s.kv_budget_bytes),
            "--prefill-stall-ratio", str(s.prefill_stall_ratio),
            "--prefill-long-prompt", str(s.prefill_long_prompt),
            "--adopt-window-s", str(s.adopt_window), "--speculative", s.speculative.value,
            "--deterministic" if s.deterministic else "--no-deterministic"])

    def _tail(self, name: str) -> str:
        return (self.paths.logs / f"{name}.log").read_text(errors="replace")[-1500:]

    def check_services(self) -> None:
        """The gateway and reaper still run (UpError if one exited)."""
        for name, p in self.procs.items():
            if name != "supervisor" and p.poll() is not None:
                raise UpError(f"{name} exited with status {p.returncode}; its log ends:\n"
                              f"{self._tail(name)}")

    def check_children(self) -> None:
        """Every service still runs: SupervisorGone for the supervisor (restarted by the
        keeper), UpError for the others."""
        self.check_services()
        sup = self.procs.get("supervisor")
        if sup is not None and sup.poll() is not None:
            raise SupervisorGone(sup.pid, sup.returncode, self._tail("supervisor"))

    def model_path(self) -> str:
        """Builds a preset if needed, settles tp, pp and the sampling defaults, and checks
        that the model can be split that way — all before any process starts."""
        from services.up import model as up_model

        path, preset = up_model.model_dir(self.paths.models, self.s.model, self.log)
        named = {k: getattr(self.s, k) for k in ("tp", "pp") if getattr(self.s, k) is not None}
        tp, pp = up_model.topology(named, preset)
        self.s = replace(self.s, tp=tp, pp=pp)
        self.sampling = up_model.sampling(named_sampling(self.s), preset)
        try:
            check_topology(path, tp, pp, model_id(path))
        except TopologyError as exc:
            raise UpError(f"cannot serve {exc}") from None
        return path

    def hosts(self) -> tuple[list[dict] | None, list[str], str]:
        """(host records, envs, backend) from --hosts (the supervisor's reader), or none."""
        if self.s.hosts is None:
            return None, [], self.s.backend
        try:
            hf = read_hosts_file(Path(self.s.hosts).expanduser())
        except HostsError as exc:
            raise UpError(f"--hosts: {exc}") from None
        return hf.hosts, hf.envs, hf.backend_for(self.s.backend)

    def preflight(self) -> None:
        s = self.s
        problems = [why] if (why := supervisor_busy(self.paths)) else []
        problems += busy_ports([
            ("--port", s.host, s.port), ("--admin-port", "127.0.0.1", s.admin_port),
            ("--events-port", "127.0.0.1", s.events_port),
            ("--control-port", "127.0.0.1", s.control_port),
            ("--report-port", "127.0.0.1", s.report_port),
            ("--reaper-events-port", "127.0.0.1", s.reaper_events_port)])
        if problems:
            raise UpError("cannot start:\n  - " + "\n  - ".join(problems))

    def run(self) -> int:
        s = self.s
        key = ensure_cluster_key(self.paths.cluster_key)
        self.admin_token = ensure_admin_token(self.paths.admin_token)
        model = self.model_path()
        hosts, envs, backend = self.hosts()
        if hosts is not None:  # as many rank slots as tp x pp, before anything starts
            try:
                members_from_host_records(hosts, slots=self.s.tp * self.s.pp * self.s.replicas)
            except HostsError as exc:
                raise UpError(f"--hosts {self.s.hosts}: {exc}") from None
        self.key = key
        self.keeper.record()  # this `up` restarts its supervisor: the reaper waits for it
        sup = self.start_supervisor({})
        self.admin = AdminLink(self.paths, key, sup.pid)
        self.admin.interrupted = self.stop_flag.is_set
        admin_ep, events_ep = self.admin.wait_endpoints(60.0, self.stop_flag, self.check_children)
        self.keeper.remember_ports()
        self.spawn("reaper", ["--events-port", str(s.reaper_events_port)])
        gw_args = ["--host", s.host, "--port", str(s.port), "--admin-endpoint", admin_ep,
                   "--events-endpoint", events_ep]
        if s.reaper_events_port:  # port 0 = a free port only the reaper knows
            gw_args += ["--reaper-events-endpoint", f"tcp://127.0.0.1:{s.reaper_events_port}"]
        self.spawn("gateway", gw_args)
        if s.replicas > 1:
            from services.up.replicas import ReplicaSet

            return ReplicaSet(self, model, hosts, envs, backend).run()
        return SingleDeployment(self, model, hosts, envs, backend).run()

    def teardown_until_proven(self, dep_id: str, why: str) -> bool:
        """The failed deployment torn down with proof. One that cannot be proven yet (a
        host unreachable: the supervisor gave up its own retries, `teardown_failed`) is
        retried with a doubling backoff while the gateway, supervisor and reaper keep
        running; the cut-off ranks end on their own meanwhile (their lease lapses: the
        launcher watchdog). True once proven; False if `up` was told to stop first."""
        delay = TEARDOWN_RETRY_S
        while True:
            try:
                out = self.admin.ask(stop.Args(dep_id, force=True), timeout=180.0).outcome
                self.log(f"old deployment torn down ({out.describe()})")
                return True
            except (UpError, BusTimeout) as exc:
                self.log(f"teardown pending: {dep_id} ({why}): {exc}; retrying in "
                         f"{delay:.0f}s (Ctrl-C stops everything)", err=True)
            if self.stop_flag.wait(delay):
                return False
            delay = min(2 * delay, TEARDOWN_RETRY_MAX_S)

    def restart_budget(self) -> RestartBudget:
        s = self.s
        return RestartBudget(s.restarts, s.restart_window, s.restart_backoff, RESTART_BACKOFF_MAX_S)

    def progress(self, dep_id: str):
        """The deployment as the supervisor has it now (DeploymentDown if it failed)."""
        self.check_children()
        dep = self.admin.deployment(dep_id)
        if dep is not None:
            self.note_ranks(dep)
            # "stopped" is an operator's unload through the admin API: not ours to undo
            if dep.state in FAILED_STATES:
                raise DeploymentDown(dep_id, dep.state, dep.error)
        return dep

    def note_ranks(self, dep) -> None:
        for r in dep.ranks:
            # a remote rank's pid is another host's: the supervisor proves it there
            if r.pid and not r.remote and r.pid not in self.rank_ids:
                self.rank_ids[r.pid] = identify(r.pid)

    def local_url(self) -> str:
        s = self.s
        return f"http://{'127.0.0.1' if s.host in ('0.0.0.0', '::') else s.host}:{s.port}"

    def reap_orphans(self) -> bool:
        """One `lockstep reaper --once` pass (the supervisor is gone and nobody restarts
        it: keeper.forget() closed the adoption window): its launches' ranks proven gone."""
        cmd = [sys.executable, "-m", "services", "reaper", "--home", str(self.paths.home), "--once"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                 timeout=120)
        except subprocess.TimeoutExpired:
            self.log("reap of the dead supervisor's launches: not done in 120 s")
            return False
        self.log(f"reap of the dead supervisor's launches (exit {out.returncode}): "
                 f"{(out.stdout + out.stderr).strip()}")
        return out.returncode == 0

    def shutdown(self) -> bool:
        """abort_all → verified teardown → stop services → prove every pid gone."""
        ok = True
        if self.admin is not None:
            self.admin.interrupted = None  # the stop's own calls are not to be cut short
        sup = self.procs.get("supervisor")
        self.keeper.forget()  # nobody restarts a supervisor any more: reap what is left
        self.notice.clear()  # nothing is coming back
        if self.admin is not None and sup is not None and sup.poll() is None:
            ok = self.admin.abort_and_teardown(self.log, self.rank_pids) and ok
        elif sup is not None:  # it died and was not restarted: its launches are orphans
            ok = self.reap_orphans() and ok
        idents = []
        for name in ("gateway", "reaper", "supervisor"):
            p = self.procs.get(name)
            if p is None:
                continue
            tree = snapshot_children(p.pid) if p.poll() is None else []
            idents += tree
            out = terminate_ladder(tree, [p.pid], term_timeout=self.s.stop_timeout, kill_timeout=5.0)
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                ok = False
            self.log(f"{name} stopped ({'/'.join(out.path) or 'already gone'}, status {p.returncode})")
        late = [identify(pid) for pid in self.rank_pids - self.rank_ids.keys()]
        ranks = [i for i in [*self.rank_ids.values(), *late] if i is not None]
        survivors = [i for i in idents + ranks if is_alive(i)]
        survivors += [p for p in self.procs.values() if p.poll() is None]
        for sv in survivors:
            self.log(f"NOT proven gone: pid {sv.pid}")
        return ok and not survivors

