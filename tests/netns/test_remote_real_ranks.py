"""Real MLX ranks (`python -m services.rank`) on two network-namespace hosts, started,
served and stopped by the real supervisor over ssh: TP=2 and PP=2 of the embedded tiny
model over MLX's ring backend between the hosts. A greedy generation through rank 0, and
a chat completion through a real gateway (the `openai` client), must equal the same
model's single-process greedy output."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.atomic_json import read_json
from common.home import Paths, manifest_path
from common.records import LaunchManifest
from tests.e2e.rank_harness import model_dir
from tests.e2e.ring_sharded_check import MAX_TOKENS, PROMPT, greedy_ids
from tests.netns.remote_support import assert_nothing_left, hosts_doc, netns_of
from tests.support.requests import RequestsClient
from tests.support.supervisor import RunningSupervisor, fake_settings

pytestmark = pytest.mark.netns

A, B = 0, 1


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[int], str]:
    """(prompt ids, greedy ids, greedy text) of the single-process model, as
    ring_sharded_check does."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir()))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True)
    ids = greedy_ids(model, tokenizer)
    return [int(t) for t in prompt], ids, tokenizer.decode(ids)


def _through_the_gateway(rs: RunningSupervisor, home, expected_text: str) -> None:
    """A real gateway (in this process, on the host) on the supervisor's admin and events
    sockets; the official client asks for the same greedy chat completion."""
    import openai

    from services.gateway.core.settings import GatewaySettings
    from tests.gwutil import GatewayThread, free_port, poll_until

    sk = rs.sup.sockets
    gw = GatewayThread(GatewaySettings(home=home, port=free_port(), refresh_s=0.5,
                                       admin_endpoint=sk.admin_endpoint,
                                       events_endpoint=sk.events_endpoint), rs.key).start()
    try:
        poll_until(lambda: gw.gw.cluster.backends, 30, "the gateway to see the deployment")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS,
                                           messages=[{"role": "user", "content": PROMPT}])
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].message.content == expected_text
    finally:
        gw.stop()


def _serve_and_stop(c, rs: RunningSupervisor, home, mode: str, reference) -> dict:
    prompt, expected, expected_text = reference
    dep_id = f"real-{mode}"
    t0 = time.monotonic()
    out = rs.ok("deploy", timeout=400, model_path=str(model_dir()), deployment_id=dep_id,
                hosts=hosts_doc(c, [A, B])["hosts"], **{mode: 2})
    launch_s = time.monotonic() - t0
    assert out["state"] == "serving"
    info = next(d for d in rs.ok("deployments")["deployments"] if d["deployment_id"] == dep_id)
    assert info["backend"] == "ring" and info["world_size"] == 2
    assert info["requests_endpoint"].startswith(f"tcp://{c.address(A)}:")
    manifest = LaunchManifest.from_dict(read_json(manifest_path(Paths(home), out["job_id"])))
    assert [netns_of(r.pid) for r in manifest.ranks] == [c.namespaces[A], c.namespaces[B]]
    assert all(r.remote for r in manifest.ranks)

    client = RequestsClient(info)
    try:
        rid = client.generate(prompt, MAX_TOKENS)
        assert client.wait_finished([rid], 120) == {rid: "length"}
        got = client.tokens(rid)
    finally:
        client.close()
    assert got == expected, f"{mode}=2 across hosts gave {got}, one process {expected}"
    _through_the_gateway(rs, home, expected_text)

    t0 = time.monotonic()
    stop = rs.ok("stop", deployment_id=dep_id, timeout=120)["outcome"]
    stop_s = time.monotonic() - t0
    assert stop["proven"], stop
    placed = [{"host": h, "pid": r.pid, "start_time": r.start_time}
              for r, h in zip(manifest.ranks, (A, B), strict=True)]
    assert_nothing_left(c, placed, out["job_id"], dep_id)
    assert not manifest_path(Paths(home), out["job_id"]).exists()
    print(f"\n{mode.upper()}=2 real ranks on 2 hosts: launch to serving {launch_s:.2f}s, "
          f"verified teardown {stop_s:.2f}s (path {stop['path']}); tokens {got}")
    return stop


@pytest.mark.timeout(900)
def test_real_ranks_tp2_then_pp2_across_two_hosts(netns_cluster, tmp_path, reference):
    c = netns_cluster
    home = tmp_path / "home"
    settings = replace(fake_settings(home), rank_command="", load_timeout=300.0,
                       canary_window_s=1.0, canary_timeout_s=120.0, stop_timeout=10.0,
                       graceful_timeout=10.0, rank_telemetry_interval_s=0.5,
                       ssh_connect_timeout=3.0, lease_ttl=60.0)
    rs = RunningSupervisor(settings)
    try:
        _serve_and_stop(c, rs, home, "tp", reference)
        _serve_and_stop(c, rs, home, "pp", reference)
        assert rs.ok("deployments")["deployments"] == []
    finally:
        rs.close()
