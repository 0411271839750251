"""The supervisor with real MLX ranks (`python -m services.rank`, ring backend over
loopback): deploy TP=2 of the embedded model (built once into $LOCKSTEP_HOME/models),
serve through rank 0, admin cache_clear through the plan (every rank's prefix cache
empty at one step), stop — every pid gone, manifest removed, markers retired."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.home import Paths, manifest_path, marker_dir
from tests.support.requests import RequestsClient
from tests.support.supervisor import RunningSupervisor, fake_settings, pid_gone, poll_for


def run(client: RequestsClient, prompt: list[int]) -> tuple[list[int], int]:
    """(tokens, cached_tokens of the first chunk) of one greedy request."""
    rid = client.generate(prompt, 4)
    assert client.wait_finished([rid], 60)[rid] == "length"
    return client.tokens(rid), client.streams[rid][0].cached_tokens


def _ranks(rs: RunningSupervisor) -> list[dict]:
    return rs.ok("status")["deployments"][0]["ranks"]


@pytest.mark.timeout(240)
def test_deploy_tp2_serve_and_verified_stop(tmp_path):
    home = tmp_path / "home"
    settings = replace(fake_settings(home), rank_command="", load_timeout=150.0,
                       canary_window_s=1.0, canary_timeout_s=60.0, stop_timeout=10.0,
                       rank_telemetry_interval_s=0.5)
    rs = RunningSupervisor(settings)
    try:
        out = rs.ok("deploy", timeout=220, tp=2, deployment_id="real")
        assert out["state"] == "serving"
        dep = rs.ok("deployments")["deployments"][0]
        assert dep["backend"] == "ring" and dep["world_size"] == 2 and dep["model"] == "tiny"
        assert dep["canary_at"] and [r["phase"] for r in dep["ranks"]] == ["serving"] * 2
        pids = [r["pid"] for r in dep["ranks"]]

        client = RequestsClient(dep)
        try:
            rids = [client.generate([1, 2, 3, 4], 8) for _ in range(2)]
            assert client.wait_finished(rids, 60) == {r: "length" for r in rids}
            a, b = (client.tokens(r) for r in rids)
            assert len(a) == 8 and a == b  # greedy: identical prompts, identical tokens

            # Admin cache_clear on real ranks: a repeated prompt hits the prefix cache,
            # the clear empties every rank's store at one plan, the next one misses.
            prompt = list(range(10, 30))
            hit = [run(client, prompt) for _ in range(2)]
            assert hit[0][1] == 0 and hit[1][1] == len(prompt) - 1 and hit[0][0] == hit[1][0]
            poll_for(lambda: all((c := r["cache"]) and c["entries"] >= 1
                                 for r in _ranks(rs)), 30, "every rank holding an entry")
            cleared = rs.ok("cache_clear", deployment_id="real", timeout=60)
            assert cleared["enabled"] and cleared["step"] > 0
            poll_for(lambda: all(r["cache"]["entries"] == 0 and r["step"] >= cleared["step"]
                                 for r in _ranks(rs)), 30, "every rank's cache empty")
            assert run(client, prompt) == (hit[0][0], 0)  # a miss, the same tokens
        finally:
            client.close()

        paths = Paths(home)
        assert manifest_path(paths, out["job_id"]).exists()
        stop = rs.ok("stop", deployment_id="real", timeout=60)
        assert stop["outcome"]["proven"] and stop["outcome"]["survivors"] == []
        assert all(pid_gone(p) for p in pids)
        assert not manifest_path(paths, out["job_id"]).exists()
        assert not marker_dir(paths, "real").exists()
        assert not (paths.secrets / f"{out['job_id']}.key").exists()
        assert rs.ok("deployments")["deployments"] == []
    finally:
        rs.close()
