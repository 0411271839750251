"""Hosts and backend selection (DESIGN.md 5.1 and "Hosts file").

A hosts file is an `mlx.launch` hostfile as it is:
    {"backend": "ring", "envs": ["K=V"], "hosts": [{"ssh": "user@host", "ips": ["10.0.0.2"]}]}
plus optional per-host fields `name`, `python` (interpreter on that host; default the
supervisor's), `home` (its $LOCKSTEP_HOME; default the supervisor's), `cwd` (directory
ranks start in; default the supervisor's source tree), `ssh_config` (an ssh client
config file, `ssh -F`), `rdma_ctl` (bool), `rdma_devices` (list), `rdma` (this host's row
of the RDMA connectivity matrix: entry j is the device that reaches host j, null for
itself or no link, as mlx.launch writes it for jaccl) and `ranks_per_host`. Ranks are
placed in host order. A host whose ssh target is 127.0.0.1, localhost or ::1 (or empty)
is this machine (`common.ssh.is_local`): launched without ssh.

Selection rule: fewer than two members → "none" (single rank, no distributed init);
`jaccl` only if every member has RDMA control enabled and at least one RDMA device (and,
where a matrix is given, a device towards every other host); otherwise `ring`. Every
blocker is named with its reason.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.messages import Backend
from common.schema import SchemaError, decode_into
from common.ssh import SshTarget, is_local

BACKENDS = (Backend.AUTO, Backend.RING, Backend.JACCL, Backend.MPI)  # what a deploy may ask


@dataclass
class HostRecord:
    ssh: str = ""
    ips: list[str] = field(default_factory=list)
    name: str = ""
    python: str = ""
    home: str = ""
    cwd: str = ""
    ssh_config: str = ""
    rdma_ctl: bool = False
    rdma_devices: list[str] = field(default_factory=list)
    rdma: list[str | None] = field(default_factory=list)
    ranks_per_host: int = 1
    envs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Member:
    """One rank slot on one host."""

    index: int  # position in placement order (= rank when launched)
    host_index: int
    host: str  # display name
    ssh: str
    ip: str
    local: bool
    rdma_ctl: bool
    rdma_devices: tuple[str, ...]
    rdma_row: tuple[str | None, ...]
    python: str = ""  # "" = the supervisor's interpreter
    home: str = ""  # "" = the supervisor's $LOCKSTEP_HOME
    cwd: str = ""  # "" = the supervisor's source tree
    ssh_config: str = ""  # "" = the supervisor's ssh_config setting

    def to_wire(self) -> dict[str, Any]:
        return {"index": self.index, "host": self.host, "ssh": self.ssh, "ip": self.ip,
                "local": self.local, "rdma_ctl": self.rdma_ctl,
                "rdma_devices": list(self.rdma_devices), "rdma": list(self.rdma_row),
                "python": self.python, "home": self.home, "cwd": self.cwd,
                "ssh_config": self.ssh_config}


@dataclass
class Selection:
    backend: Backend  # none | ring | jaccl | mpi
    members: list[Member]
    blockers: list[dict[str, str]]

    def to_wire(self) -> dict[str, Any]:
        return {"backend": self.backend.value, "members": [m.to_wire() for m in self.members],
                "blockers": list(self.blockers)}


class HostsError(ValueError):
    """A host record or hosts file that cannot be used; the message names the field."""


def local_host() -> HostRecord:
    return HostRecord(ssh="localhost", ips=["127.0.0.1"], name=socket.gethostname())


def decode_hosts(raw: Any) -> list[HostRecord]:
    if type(raw) is not list or not raw:
        raise HostsError("hosts: expected a non-empty list of host records")
    out = []
    for i, rec in enumerate(raw):
        try:
            out.append(decode_into(HostRecord, rec, prefix=f"hosts[{i}]."))
        except SchemaError as exc:
            raise HostsError(f"{exc.reason}: {exc.detail}") from None
        if out[-1].ranks_per_host < 1:
            raise HostsError(f"hosts[{i}].ranks_per_host: must be >= 1")
        if out[-1].ssh:
            try:
                SshTarget(out[-1].ssh)
            except ValueError as exc:
                raise HostsError(f"hosts[{i}].ssh: {exc}") from None
        for name in ("python", "home", "cwd"):
            value = getattr(out[-1], name)
            if value and not value.startswith("/"):
                raise HostsError(f"hosts[{i}].{name}: {value!r} must be an absolute path")
    return out


@dataclass(frozen=True)
class HostsFile:
    """An mlx.launch hostfile, read once by read_hosts_file: what every reader keeps."""

    hosts: list[dict[str, Any]]  # the host records as written (validated), the file's
    #                              top-level ranks_per_host applied: a deploy's `hosts`
    backend: Backend | None  # the file's backend, if it names one
    envs: list[str]  # KEY=VALUE for every rank

    def backend_for(self, requested: Backend | str) -> Backend | str:
        """The deploy's backend: the file's where the deploy asked for auto."""
        return self.backend if requested == Backend.AUTO and self.backend else requested


def read_hosts_file(path: Path) -> HostsFile:
    """Parse an mlx.launch hostfile. A bare list of host records is accepted too;
    `ranks_per_host` at top level applies to every host that does not set its own."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostsError(f"hosts file {path}: {exc}") from None
    if isinstance(doc, list):
        doc = {"hosts": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("hosts"), list):
        raise HostsError(f"hosts file {path}: expected an object with a 'hosts' list")
    hosts = [dict(h) for h in doc["hosts"] if isinstance(h, dict)]
    if len(hosts) != len(doc["hosts"]):
        raise HostsError(f"hosts file {path}: every host must be an object")
    rph = doc.get("ranks_per_host")
    if rph is not None:
        for h in hosts:
            h.setdefault("ranks_per_host", rph)
    decode_hosts(hosts)  # validate now, with the file's name in the error
    backend = doc.get("backend")
    if backend and backend not in BACKENDS:
        raise HostsError(f"hosts file {path}: backend: must be one of {', '.join(BACKENDS)}")
    return HostsFile(hosts, Backend(backend) if backend else None, list(doc.get("envs") or []))


def members_from_host_records(records: list[HostRecord] | list[dict], *,
                              slots: int | None = None) -> list[Member]:
    """One Member per rank slot, in host order. `slots` (the world size) truncates the
    placement; fewer slots than asked is an error. Dicts are decoded strictly."""
    recs = decode_hosts(records) if records and isinstance(records[0], dict) else list(records)
    members: list[Member] = []
    for h, rec in enumerate(recs):
        local = not rec.ssh or is_local(rec.ssh)
        ip = rec.ips[0] if rec.ips else ("127.0.0.1" if local else SshTarget(rec.ssh).host)
        name = rec.name or rec.ssh or ip
        for _ in range(rec.ranks_per_host):
            members.append(Member(len(members), h, name, rec.ssh, ip, local, rec.rdma_ctl,
                                  tuple(rec.rdma_devices), tuple(rec.rdma), rec.python,
                                  rec.home, rec.cwd, rec.ssh_config))
    if slots is not None:
        if len(members) < slots:
            raise HostsError(f"the hosts provide {len(members)} rank slot(s) but the plan needs "
                             f"{slots}; add hosts or set ranks_per_host")
        members = members[:slots]
    return members


def _rdma_blockers(m: Member, host_count: int, hosts_used: set[int]) -> list[str]:
    reasons = []
    if not m.rdma_ctl:
        reasons.append("RDMA control is not enabled (rdma_ctl false)")
    devices = [d for d in (*m.rdma_devices, *m.rdma_row) if d]
    if not devices:
        reasons.append("no RDMA device")
    if not m.rdma_row and len(m.rdma_devices) > 1:
        reasons.append(f"{len(m.rdma_devices)} RDMA devices and no connectivity matrix "
                       "(rdma): which device reaches which host is unknown")
    if m.rdma_row:
        if len(m.rdma_row) < host_count:
            reasons.append(f"RDMA matrix row has {len(m.rdma_row)} entries for {host_count} hosts")
        else:
            for j in sorted(hosts_used - {m.host_index}):
                if not m.rdma_row[j]:
                    reasons.append(f"no RDMA link to host {j}")
    return reasons


def jaccl_devices(members: list[Member]) -> list[list[str | None]]:
    """MLX_IBV_DEVICES for jaccl, indexed by rank: row i, column j is the device rank i
    uses toward rank j (None toward itself). From the host's matrix row when given,
    else its one device toward every other host (several devices without a matrix is a
    blocker, see _rdma_blockers)."""
    out = []
    for a in members:
        row: list[str | None] = []
        for b in members:
            if a.index == b.index:
                row.append(None)
            elif a.rdma_row:
                row.append(a.rdma_row[b.host_index] if b.host_index < len(a.rdma_row) else None)
            else:
                row.append(a.rdma_devices[0] if a.rdma_devices else None)
        out.append(row)
    return out


def select_backend(members: list[Member], requested: Backend | str = Backend.AUTO) -> Selection:
    """Apply the selection rule; an explicit request is honoured except that jaccl with
    blockers is refused by the caller (the blockers are always listed)."""
    if requested not in BACKENDS:
        raise HostsError(f"backend: must be one of {', '.join(BACKENDS)}")
    requested = Backend(requested)
    if len(members) < 2:
        why = "fewer than two members: single rank, no distributed init"
        return Selection(Backend.NONE, members, [{"member": m.host, "reason": why} for m in members]
                         or [{"member": "", "reason": why}])
    host_count = max(m.host_index for m in members) + 1
    used = {m.host_index for m in members}
    blockers = []
    seen: set[int] = set()
    for m in members:
        if m.host_index in seen:
            continue
        seen.add(m.host_index)
        blockers += [{"member": m.host, "reason": r} for r in _rdma_blockers(m, host_count, used)]
        per_host = sum(1 for x in members if x.host_index == m.host_index)
        if per_host > 1:
            blockers.append({"member": m.host,
                             "reason": f"{per_host} ranks on one host: jaccl runs one per host"})
    if requested == Backend.AUTO:
        backend = Backend.RING if blockers else Backend.JACCL
    else:
        backend = requested
    return Selection(backend, members, blockers)
