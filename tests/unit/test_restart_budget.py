"""`lockstep up`'s redeploy budget is a rate (services/up/restart_budget.py), on a fake
clock: N inside the window and the next is refused; spaced past the window they never
run out; the backoff doubles between consecutive redeploys and counts from the last."""

from __future__ import annotations

from services.up.restart_budget import Exhausted, Redeploy, RestartBudget


def budget(limit: int = 3, window: float = 600.0) -> RestartBudget:
    return RestartBudget(limit, window, backoff_s=2.0, backoff_max_s=10.0)


def test_n_inside_the_window_then_exhausted_naming_the_rate():
    b = budget()
    for i, now in enumerate((0.0, 100.0, 200.0)):
        d = b.decide(now)
        assert isinstance(d, Redeploy) and d.used == i + 1
        b.record(now)
    d = b.decide(300.0)
    assert d == Exhausted(3, 600.0)
    assert "3 redeploy(s) in the last 600s" in d.reason()
    assert b.left(300.0) == 0


def test_spaced_past_the_window_they_never_run_out():
    b = budget(limit=2, window=60.0)
    for k in range(20):  # one fault every 61 s, for 20 minutes
        now = 61.0 * k
        d = b.decide(now)
        assert d == Redeploy(0.0, 1), (k, d)
        b.record(now)


def test_the_window_slides():
    b = budget(limit=2, window=60.0)
    b.record(0.0)
    b.record(50.0)
    assert isinstance(b.decide(59.0), Exhausted)
    assert isinstance(b.decide(60.0), Redeploy)  # the first left the window


def test_backoff_doubles_counts_from_the_last_redeploy_and_is_capped():
    b = budget(limit=10)
    assert b.decide(0.0).delay_s == 0.0  # the first after a quiet spell: at once
    b.record(0.0)
    assert b.decide(0.5).delay_s == 1.5  # 2 s after the last, 0.5 s of it passed
    b.record(2.0)
    assert b.decide(2.0).delay_s == 4.0
    b.record(6.0)
    assert b.decide(6.0).delay_s == 8.0
    b.record(14.0)
    assert b.decide(14.0).delay_s == 10.0  # capped
    assert b.decide(30.0).delay_s == 0.0  # long since the last one


def test_the_banner_states_both_budgets_and_the_adopt_window():
    from services.up.banner import recovery_text
    from services.up.settings import UpSettings

    text = recovery_text(UpSettings(restarts=2, restart_window=300.0, restart_backoff=1.5,
                                    supervisor_restarts=4, adopt_window=20.0))
    assert text == ("redeploys at most 2 within 300s (backoff from 1.5s); supervisor restarted "
                    "at most 4 within the window, ranks wait 20s to be adopted")
    off = recovery_text(UpSettings(supervisor_restarts=0))
    assert off.endswith("supervisor not restarted (--supervisor-restarts 0)")
