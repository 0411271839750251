"""Admin cache_clear against fake ranks (tests/fakes/fake_rank.py, whose rank 0 keeps a
toy prefix cache): CACHE_CLEAR reaches rank 0 through the control channel, is re-sent
until CACHE_CLEARED comes back and applied once; status shows each rank's cache figures
from telemetry; no answer is a typed `timeout`, no deployment `not_found`."""

from __future__ import annotations

import pytest

from services.admin import cli as admin_cli
from tests.support.requests import RequestsClient
from tests.support.supervisor import poll_for


def _ranks(rs, dep_id):
    dep = next(d for d in rs.ok("status")["deployments"] if d["deployment_id"] == dep_id)
    return dep["ranks"]


def _entries(rs, dep_id) -> int | None:
    cache = _ranks(rs, dep_id)[0]["cache"]
    return None if cache is None else cache["entries"]


def _first_cached(client, prompt, n=3) -> int:
    rid = client.generate(prompt, n)
    assert client.wait_finished([rid], 10)[rid] == "length"
    return client.streams[rid][0].cached_tokens


@pytest.mark.timeout(60)
def test_cache_clear_empties_the_cache_at_a_step_and_status_shows_it(start_supervisor,
                                                                    model_dir, home, capsys):
    rs = start_supervisor()
    dep = rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="cc")
    client = RequestsClient(next(d for d in rs.ok("deployments")["deployments"]
                                 if d["deployment_id"] == "cc"))
    try:
        first = rs.ok("cache_clear", deployment_id="cc")  # what the canary left
        poll_for(lambda: _entries(rs, "cc") == 0, 10, "rank 0 telemetry: cache empty")
        prompt = list(range(901, 911))
        assert _first_cached(client, prompt) == 0  # a miss
        assert _first_cached(client, prompt) == 9  # the whole prompt but its last token
        poll_for(lambda: _entries(rs, "cc") == 2, 10, "rank 0 telemetry: 2 cache entries")
        assert admin_cli.main(["--home", str(home), "status"]) == 0
        assert "cache 2 entries" in capsys.readouterr().out

        out = rs.ok("cache_clear", deployment_id="cc")
        assert out["deployment_id"] == "cc" and out["enabled"] is True
        assert out["clear_id"] > first["clear_id"] and out["sends"] >= 1
        assert out["step"] >= first["step"]
        poll_for(lambda: _entries(rs, "cc") == 0, 10, "rank 0 telemetry: cache empty")
        assert _first_cached(client, prompt) == 0  # nothing left to hit

        assert admin_cli.main(["--home", str(home), "cache-clear", "cc"]) == 0
        assert "every rank's prefix cache emptied at step" in capsys.readouterr().out
    finally:
        client.close()
    assert dep["deployment_id"] == "cc"


@pytest.mark.timeout(60)
def test_a_dropped_clear_is_resent_until_answered(start_supervisor, model_dir):
    rs = start_supervisor(rank_env={"LOCKSTEP_FAKE_DROP_CACHE_CLEARS": "2"})
    rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="lossy")
    out = rs.ok("cache_clear", deployment_id="lossy", timeout_s=10.0)
    assert out["sends"] >= 3, out  # two copies lost on the way, the third answered


@pytest.mark.timeout(60)
def test_no_answer_is_a_timeout_and_no_deployment_is_not_found(start_supervisor, model_dir,
                                                               home, capsys):
    rs = start_supervisor(rank_env={"LOCKSTEP_FAKE_DROP_CACHE_CLEARS": "1000000"})
    rs.ok("deploy", model_path=str(model_dir), tp=1, deployment_id="mute")
    reply = rs.call("cache_clear", deployment_id="mute", timeout_s=0.6)
    assert (reply.ok, reply.code) == (False, "timeout")
    assert reply.data["sends"] >= 2 and reply.data["clear_id"] >= 1
    missing = rs.call("cache_clear", deployment_id="nope")
    assert (missing.ok, missing.code) == (False, "not_found")
    bad = rs.call("cache_clear", deployment_id="mute", timeout_s=0)
    assert (bad.ok, bad.code) == (False, "bad_request")
    assert admin_cli.main(["--home", str(home), "cache-clear", "nope"]) == 1
    assert "error [not_found]" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_with_the_cache_off_there_is_nothing_to_clear(start_supervisor, model_dir):
    rs = start_supervisor(prompt_cache_entries=0)
    rs.ok("deploy", model_path=str(model_dir), tp=2, deployment_id="off")
    out = rs.ok("cache_clear", deployment_id="off")
    assert out["enabled"] is False
    poll_for(lambda: _ranks(rs, "off")[0]["last_seen"] > 0, 10, "telemetry")
    assert [r["cache"] for r in _ranks(rs, "off")] == [None, None]
