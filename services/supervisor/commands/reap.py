"""reap — one reap pass now (the same pass that runs at start and before every launch).

    request  {}
    reply    {reaped: [job_id], active: [job_id], failures: [{job_id, reason, survivors}],
              unreadable: [{path, error}], ...}   (the ReapReport; `blocking` true means
              launches are refused until fixed — the reply is still ok)
    CLI      lockstep admin reap
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.supervisor.errors import AdminError

if TYPE_CHECKING:
    from services.supervisor.interfaces import CommandHost


@dataclass
class Args:
    pass


async def run(sup: CommandHost, args: Args) -> dict:
    try:
        return await sup.reap()
    except AdminError as exc:
        if exc.code == "reap_blocked":
            return exc.data
        raise
