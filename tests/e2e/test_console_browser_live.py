"""The operator console (/admin/) in a real browser: Debian's chromium, headless, driven
by selenium through the system chromedriver (no browser download), against the shared
live TP=2 `lockstep up` (tests/support/live_cluster.py). Login from the fragment →
serving; a long stream in the requests table, aborted from the page (finish_reason
"abort", every rank's removal record); the page at scale (a stub of fetch). A follower
SIGKILLed → the incident and the redeploy, and `lockstep admin watch`, are in
test_up_restart.py, on a cluster of their own. Screenshots of each state go to the
module's tmp dir."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.gwutil import poll_until, sse_lines
from tests.support import live_cluster as lc
from tests.support.console_browser import cells, needs_chromium, open_browser, ranks_serving
from tests.support.console_browser import shot as _shot

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def browser():
    with open_browser() as drv:
        yield drv


def shot(shots: Path, drv, name: str):
    return _shot(shots, drv, name)


@pytest.mark.timeout(60)
def test_page_is_static_and_strict(live):
    r = httpx.get(live.url + "/admin/", timeout=10)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp, csp
    assert "<script src=\"/admin/console.js\"" in r.text
    assert "<script>" not in r.text and " on" + "click" not in r.text  # no inline script
    assert live.token not in r.text
    js = httpx.get(live.url + "/admin/console.js", timeout=10)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(live.url + "/admin/secret.txt", timeout=10).status_code == 404
    assert httpx.get(live.url + "/admin/api/requests", timeout=10).status_code == 401
    abort = live.url + "/admin/api/requests/nope/abort"
    assert httpx.post(abort, timeout=10).status_code == 401
    r = httpx.post(abort, headers=live.hdr, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


@pytest.mark.timeout(60)
def test_wrong_token_shows_login(live, browser, shots):
    browser.get(live.url + "/admin/#token=not-the-token")
    poll_until(lambda: browser.execute_script(
        "return !document.querySelector('#login').hidden && "
        "document.querySelector('#login-error').textContent"), 15, "the login form")
    assert browser.execute_script("return location.hash") == ""
    assert browser.execute_script("return sessionStorage.length") == 0  # dropped on 401
    shot(shots, browser, "login")


@pytest.mark.timeout(60)
def test_login_from_fragment_shows_serving(live, browser, shots):
    dep = live.dep
    assert live.link == live.url + "/admin/#token=" + live.token
    assert live.token not in (live.home / "runtime" / "logs" / "up.log").read_text()
    browser.get(live.link)
    poll_until(lambda: (cells(browser, "#deployments", dep["deployment_id"]) or [""] * 6)[5]
               == "serving", 15, "the deployment serving on the page")
    poll_until(lambda: ranks_serving(browser, dep["deployment_id"], 2), 15,
               "both ranks serving on the page")
    assert browser.execute_script("return location.hash") == ""  # off the address bar
    assert live.token not in browser.current_url
    row = cells(browser, "#deployments", dep["deployment_id"])
    assert row[1] == dep["model"] and row[2] == "2×1", row
    assert "launching → loading → canary → serving" in row[6], row
    rank1 = cells(browser, "#ranks", f"{dep['deployment_id']}/1")
    assert rank1[3] == str(dep["ranks"][1]["pid"]) and rank1[8] != "0", rank1  # pid, memory
    # KV held / the budget `up` resolved (auto: the host's memory less the weights) / peak
    assert re.fullmatch(r"\S+( \S+)? / \d+\.\d [KMG]iB \(peak \S+( \S+)?\)", rank1[9]), rank1
    assert re.match(r"0 waiting; waits \d+, preempted 0, refused 0", row[10]), row  # queue
    shot(shots, browser, "serving")


def _long_stream(live: lc.LiveView, sink: dict) -> None:
    body = {"model": live.dep["model"], "prompt": "the long road", "max_tokens": 3000,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as resp:
        sink["rid"] = resp.headers["x-lockstep-request-id"]
        for kind, d in sse_lines(resp):
            if kind == "data" and d != "[DONE]" and d["choices"]:
                sink["n"] = sink.get("n", 0) + 1
                if d["choices"][0]["finish_reason"]:
                    sink["finish"] = d["choices"][0]["finish_reason"]
    sink["done"] = True


@pytest.mark.timeout(90)
def test_abort_from_the_requests_table(live, browser, shots):
    from selenium.webdriver.common.by import By

    sink: dict = {}
    t = threading.Thread(target=_long_stream, args=(live, sink), daemon=True)
    t.start()
    rid = poll_until(lambda: sink.get("rid"), 30, "the stream's request id")
    poll_until(lambda: (row := cells(browser, "#requests", rid)) and int(row[6]) > 0, 20,
               "the stream in the requests table, generating")
    row = cells(browser, "#requests", rid)
    assert row[1] == live.dep["model"] and int(row[4]) > 0 and row[9] == "running", row
    shot(shots, browser, "request")
    browser.find_element(By.CSS_SELECTOR, f'#requests tr[data-rid="{rid}"] button.abort').click()
    t.join(30)
    assert sink.get("done") and sink.get("finish") == "abort", sink
    recs = poll_until(lambda: (lambda r: r if len(r) == 2 else None)(
        live.removals(rid)), 15, "every rank's removal record of the aborted request")
    assert {r["reason"] for r in recs.values()} == {"abort"}, recs
    assert len({r["step"] for r in recs.values()}) == 1, recs  # the same step on every rank
    poll_until(lambda: cells(browser, "#requests", rid) is None, 10, "the row gone")


# 8 deployments of 2 ranks and 64 requests in flight, served to the page by a stub of
# fetch injected before its script runs (the page itself is the real one).
SCALE_STUB = r"""
(() => {
  const deps = [], reqs = [], t0 = Date.now() / 1000;
  for (let d = 0; d < 8; d++) {
    const id = "dep-" + d;
    deps.push({deployment_id: id, job_id: "j-" + d, state: "serving", model: "m" + d,
      model_path: "/m", tp: 2, pp: 1, backend: "ring", world_size: 2, requests_endpoint: "",
      requests_key_sealed: "", canary_at: t0, error: null, teardown: null,
      ranks: [0, 1].map((r) => ({rank: r, host: "h" + r, remote: false, pid: 1000 + 2 * d + r,
        phase: "serving", step: 10, active: 8, cancel_epoch: 0, acked_epoch: 0,
        mem_active: 1 << 30, last_seen: t0, rejects: {}, cache: null, load: null}))});
    for (let q = 0; q < 8; q++) reqs.push({request_id: "r-" + d + "-" + q, deployment_id: id,
      model: "m" + d, age_s: q, prompt_tokens: 10, cached_tokens: 0, generated_tokens: q,
      model_ttft_ms: 5, visible_ttft_ms: 6, finished: false, aborting: false, abort_reason: null});
  }
  let n = 0;
  window.fetch = async (path) => {
    n++;
    const now = Date.now() / 1000;
    const body = path.endsWith("/status")
      ? {deployments: deps.map((d) => Object.assign({}, d, {ranks: d.ranks.map((r) =>
          Object.assign({}, r, {step: 10 + n, last_seen: now}))})),
         cancel_epoch: 0, rejections: [], events: []}
      : {at: now, requests: reqs.map((q) => Object.assign({}, q, {generated_tokens: q.generated_tokens + n})),
         deployments: Object.fromEntries(deps.map((d) => [d.deployment_id,
           {active: 8, tokens_out: 100 * n, lost: null, overloads: {}}]))};
    return {ok: true, status: 200, json: async () => body};
  };
})();
"""


@pytest.mark.timeout(60)
def test_page_stays_usable_with_8_deployments_and_64_requests(live, browser, shots):
    sid = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                  {"source": SCALE_STUB})["identifier"]
    try:
        browser.get("about:blank")  # a new document (the same URL but its fragment is not)
        browser.get(live.url + "/admin/#token=stub")
        count = "return document.querySelectorAll(arguments[0] + ' tbody tr').length"
        poll_until(lambda: browser.execute_script(count, "#requests") == 64, 15, "64 request rows")
        assert browser.execute_script(count, "#deployments") == 8
        assert browser.execute_script(count, "#ranks") == 16
        # keyed rows: the same button element across polls (a click never lands on a
        # replaced row), its counters updated in place
        browser.execute_script("window.__b = document.querySelector("
                               "'#requests tr[data-rid=\"r-7-7\"] button.abort')")
        before = cells(browser, "#requests", "r-7-7")[6]
        poll_until(lambda: cells(browser, "#requests", "r-7-7")[6] != before, 5, "a later poll")
        assert browser.execute_script("return window.__b === document.querySelector("
                                      "'#requests tr[data-rid=\"r-7-7\"] button.abort') "
                                      "&& document.contains(window.__b)")
        shot(shots, browser, "scale")
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": sid})
