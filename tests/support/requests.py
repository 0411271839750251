"""A minimal gateway stand-in: a DEALER on rank 0's requests socket with the launch's
requests key (sealed in the authenticated `deployments` admin reply; opened with the
cluster key)."""

from __future__ import annotations

import time

import zmq

from common.bus import Channel, configure, new_request_id
from common.envelope import Key
from common.keys import KeyFileError, requests_key_of
from common.messages import REQUESTS_OUT, Generate, Tokens
from services.gateway.admin.api import GATEWAY_FIELDS

CLUSTER_KEYS: list[Key] = []  # cluster keys of supervisors tests started (RunningSupervisor)


def supervisor_record(dep: dict) -> dict:
    """A deployment from the gateway's admin API as the supervisor sent it (without the
    fields the gateway adds), for the strict DeploymentInfo reader."""
    return {k: v for k, v in dep.items() if k not in GATEWAY_FIELDS}


def open_requests_key(dep_info: dict, cluster_key: Key | None = None) -> Key:
    """The requests key sealed in a DeploymentInfo, opened with `cluster_key` or with the
    key of any supervisor this test process started."""
    dep_info = supervisor_record(dep_info)
    for key in [cluster_key] if cluster_key is not None else CLUSTER_KEYS[::-1]:
        try:
            return requests_key_of(dep_info, key)
        except (KeyFileError, ValueError):
            continue
    raise AssertionError(f"no known cluster key opens the requests key of "
                         f"{dep_info.get('deployment_id')}")


class RequestsClient:
    def __init__(self, dep_info: dict, cluster_key: Key | None = None) -> None:
        self.ctx = zmq.Context()
        key = open_requests_key(dep_info, cluster_key)
        self.channel = Channel("test", "requests", sender=f"test:{new_request_id()}",
                               send_key=key, accept=REQUESTS_OUT)
        self.sock = configure(self.ctx.socket(zmq.DEALER))
        self.sock.connect(dep_info["requests_endpoint"])
        self.streams: dict[str, list[Tokens]] = {}
        self.heartbeats: dict[str, int] = {}  # rank 0's "still waiting" chunks, kept apart

    def generate(self, prompt: list[int], max_tokens: int) -> str:
        rid = new_request_id()
        self.streams[rid] = []
        self.sock.send(self.channel.pack(Generate(request_id=rid, prompt=prompt,
                                                  max_tokens=max_tokens)))  # greedy
        return rid

    def pump(self, timeout: float = 0.05) -> None:
        while self.sock.poll(int(timeout * 1000)):
            msg = self.channel.unpack_dealer(self.sock.recv_multipart())
            body = None if msg is None else msg.body
            for c in getattr(body, "chunks", None) or ([body] if isinstance(body, Tokens) else []):
                if c.waiting:
                    self.heartbeats[c.request_id] = self.heartbeats.get(c.request_id, 0) + 1
                    continue
                self.streams.setdefault(c.request_id, []).append(c)
            timeout = 0

    def finish_reason(self, rid: str) -> str | None:
        chunks = self.streams.get(rid) or []
        return chunks[-1].finish_reason if chunks else None

    def wait_finished(self, rids: list[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.05)
            if all(self.finish_reason(r) for r in rids):
                break
        return {r: self.finish_reason(r) for r in rids}

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.streams.get(rid, []) for t in c.tokens]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
