"""Replica placement over a hosts file (services/supervisor/replicas.py): replica r takes
the next tp×pp rank slots, a host's slots being its ranks_per_host."""

from __future__ import annotations

import pytest

from services.supervisor.errors import AdminError
from services.supervisor.replicas import check, place, replica_id


def host(name: str, **kw) -> dict:
    return {"ssh": f"root@{name}", "ips": [name], **kw}


def test_each_replica_takes_the_next_slots_in_order():
    hosts = [host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.1"), host("10.0.0.2")]
    assert place(hosts, 0, 2, 2) == [{**hosts[0], "ranks_per_host": 1},
                                     {**hosts[1], "ranks_per_host": 1}]
    assert place(hosts, 1, 2, 2) == [{**hosts[2], "ranks_per_host": 1},
                                     {**hosts[3], "ranks_per_host": 1}]


def test_a_hosts_slots_are_its_ranks_per_host():
    hosts = [host("a", ranks_per_host=3), host("b", ranks_per_host=1)]
    assert place(hosts, 0, 2, 2) == [{**hosts[0], "ranks_per_host": 2}]
    assert place(hosts, 1, 2, 2) == [{**hosts[0], "ranks_per_host": 1},
                                     {**hosts[1], "ranks_per_host": 1}]


def test_too_few_slots_and_bad_counts_are_refused_naming_them():
    with pytest.raises(AdminError, match="2 rank slot.*3 replica.*need 6"):
        place([host("a"), host("b")], 0, 3, 2)
    with pytest.raises(AdminError, match="replicas: must be within 1..16"):
        check(0, None)
    with pytest.raises(AdminError, match="replica: must be within 0..1"):
        check(2, 2)
    check(2, 1)


def test_this_machine_only_stays_local_and_ids_name_the_replica():
    assert place(None, 1, 2, 2) is None
    assert replica_id("d-1", 3) == "d-1-r3"
