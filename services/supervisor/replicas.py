"""Replicas: N deployments of one model, each with its own tp×pp ranks, placed over the
hosts file in order — replica r takes the next tp×pp rank slots (a host's slots are its
`ranks_per_host`). On this machine alone every replica is local, on loopback.

Each replica is a whole deployment (own launch secret, manifest, barrier, canary and
verified teardown); the gateway serves them under one model name and routes between
them (services/gateway/core/router.py).
"""

from __future__ import annotations

from typing import Any

from services.supervisor.errors import AdminError
from services.supervisor.hosts import HostsError, decode_hosts

MAX_REPLICAS = 16


def check(replicas: int, replica: int | None) -> None:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise AdminError("bad_request", f"replicas: must be within 1..{MAX_REPLICAS}")
    if replica is not None and not 0 <= replica < replicas:
        raise AdminError("bad_request", f"replica: must be within 0..{replicas - 1}")


def place(hosts: list[dict[str, Any]] | None, replica: int, replicas: int,
          world: int) -> list[dict[str, Any]] | None:
    """Replica `replica`'s host records: rank slots [replica*world, (replica+1)*world) of
    the hosts file, consecutive slots of one host merged back into one record. None
    (this machine only) stays None: every replica runs here."""
    if hosts is None:
        return None
    try:
        records = decode_hosts(hosts)
    except HostsError as exc:
        raise AdminError("bad_request", str(exc)) from None
    slots = [i for i, rec in enumerate(records) for _ in range(rec.ranks_per_host)]
    need = replicas * world
    if len(slots) < need:
        raise AdminError("bad_request", f"the hosts provide {len(slots)} rank slot(s) but "
                         f"{replicas} replica(s) of tp×pp={world} need {need}; add hosts "
                         "or set ranks_per_host")
    mine = slots[replica * world:(replica + 1) * world]
    out: list[dict[str, Any]] = []
    for i in mine:
        if out and out[-1]["_index"] == i:
            out[-1]["ranks_per_host"] += 1
        else:
            out.append({**hosts[i], "_index": i, "ranks_per_host": 1})
    for rec in out:
        del rec["_index"]
    return out


def replica_id(base: str, replica: int) -> str:
    return f"{base}-r{replica}"
