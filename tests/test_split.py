"""The served-split statistics (issue 22): the p-value, the judging rule, the windows."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from publisher.core.values import Backend, MapKey, Route
from publisher.split.stats import (
    ENOUGH_REQUESTS,
    MAX_WINDOW_SECONDS,
    MIN_REQUESTS,
    SplitWindows,
    chi_square_survival,
    describe,
    judge,
)

KEY = MapKey("prod", "chat")


def route(*weights: int) -> Route:
    return Route("chat.prod", tuple(Backend(f"worker-{chr(97 + i)}", f"http://10.0.0.{i + 1}:80", w) for i, w in enumerate(weights)))


def multinomial(rng: random.Random, shares: list[float], n: int) -> list[int]:
    """Envoy's weighted clusters: each request drawn independently."""
    drawn = Counter(rng.choices(range(len(shares)), weights=shares, k=n))
    return [drawn.get(i, 0) for i in range(len(shares))]


def smooth_weighted_round_robin(weights: list[int], n: int) -> list[int]:
    """NGINX's pick, from a fresh start (the heavy backends come first)."""
    current = [0] * len(weights)
    counts = [0] * len(weights)
    total = sum(weights)
    for _ in range(n):
        for i, w in enumerate(weights):
            current[i] += w
        best = max(range(len(weights)), key=lambda i: current[i])
        current[best] -= total
        counts[best] += 1
    return counts


def counts_of(r: Route, counts: list[int]) -> dict[str, int]:
    return {b.cluster: n for b, n in zip(r.backends, counts, strict=True)}


@given(st.floats(min_value=0.0, max_value=400.0))
def test_the_survival_function_matches_the_closed_forms(x: float) -> None:
    # One degree of freedom: erfc(sqrt(x/2)); an even number 2k: exp(-x/2) * sum (x/2)^i / i!.
    assert chi_square_survival(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-300)
    for k in (1, 2, 3, 5):
        closed = math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(k))
        assert chi_square_survival(x, 2 * k) == pytest.approx(closed, rel=1e-9, abs=1e-300)


def test_the_survival_function_at_textbook_critical_values() -> None:
    assert chi_square_survival(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi_square_survival(7.815, 3) == pytest.approx(0.05, abs=1e-4)
    assert chi_square_survival(0.0, 3) == 1.0


def test_correct_gateways_raise_no_false_alarm() -> None:
    """Rounds of 100 maps, each of a random 4-backend table, served exactly to the weights by an
    Envoy (multinomial) and by NGINX (round robin from a fresh start): not one window is off."""
    rng = random.Random(20261201)
    off = 0
    judged = 0
    for _ in range(12):
        tables = [[rng.choice([0, 1, 2, 3, 5, 8, 13]) or 1 for _ in range(3)] + [rng.choice([0, 1, 4])] for _ in range(100)]
        for weights in tables:
            r = route(*weights)
            n = rng.randrange(MIN_REQUESTS, 3 * ENOUGH_REQUESTS)
            for served in (multinomial(rng, [float(w) for w in weights], n), smooth_weighted_round_robin(weights, n)):
                judged += 1
                off += judge(counts_of(r, served), r, len(tables)).verdict == "off"
    assert judged == 2400
    assert off == 0


def test_a_ten_point_skew_is_caught_at_two_thousand_requests() -> None:
    rng = random.Random(7)
    r = route(20, 30, 50)
    caught = 0
    for _ in range(50):
        served = multinomial(rng, [0.30, 0.20, 0.50], ENOUGH_REQUESTS)
        judgment = judge(counts_of(r, served), r, 10_000)
        caught += judgment.verdict == "off"
        assert judgment.largest_deviation > 0.05
    assert caught == 50


def test_a_skew_under_five_points_is_not_worth_an_alarm_however_significant() -> None:
    r = route(50, 50)
    judgment = judge({"worker-a": 54_000, "worker-b": 46_000}, r, 1)
    assert judgment.p_value is not None and judgment.p_value < 1e-100
    assert judgment.verdict == "fine"


def test_any_request_to_a_weight_zero_backend_is_off_at_once() -> None:
    r = route(1, 1, 0)
    judgment = judge({"worker-a": 20, "worker-b": 20, "worker-c": 1}, r, 1)
    assert judgment.verdict == "off" and "worker-c" in judgment.why


def test_few_requests_give_no_verdict() -> None:
    r = route(1, 0)
    judgment = judge({"worker-a": MIN_REQUESTS - 1}, r, 1)
    assert judgment.verdict == "few_requests"
    assert judgment.why == f"few requests ({MIN_REQUESTS - 1} of {MIN_REQUESTS})"


def test_the_message_names_the_observed_shares_and_the_weights() -> None:
    r = route(20, 30, 50)
    judgment = judge({"worker-a": 842, "worker-b": 2189, "worker-c": 1179}, r, 1)
    assert describe(judgment, r, "envoy gw-1") == (
        "served split on envoy gw-1 over 4,210 requests: worker-a 20%, worker-b 52%, worker-c 28% (weights 20/30/50)"
    )


def feed(windows: SplitWindows, instance: str, counts: dict[str, int], start: float | None, end: float) -> list[str]:
    windows.add(KEY, instance, counts, start, end)
    return [j.verdict for _, _, j in windows.judge_due(end)]


def test_a_map_is_reported_off_after_two_off_windows_in_a_row_and_cleared_by_the_first_fine_one() -> None:
    """Issue 27: a false off took two clean windows to clear (28 minutes on a quiet map); it now
    clears as fast as it was raised."""
    r = route(1, 1)
    skewed = {"worker-a": 1500, "worker-b": 500}
    even = {"worker-a": 1000, "worker-b": 1000}
    windows = SplitWindows()
    windows.route_changed(KEY, r, 0.0)
    assert feed(windows, "gw-1", even, None, 10.0) == []  # an instance's first report: its start is not known
    assert feed(windows, "gw-1", skewed, 10.0, 20.0) == ["off"]
    assert windows.state(KEY, "gw-1")[0] == "few_requests" and not windows.off()
    assert feed(windows, "gw-1", even, 20.0, 30.0) == ["fine"]
    assert feed(windows, "gw-1", skewed, 30.0, 40.0) == ["off"]
    assert not windows.off() and windows.state(KEY, "gw-1")[0] == "verified"
    assert feed(windows, "gw-1", skewed, 40.0, 50.0) == ["off"]
    assert list(windows.off()) == [(KEY, "gw-1")] and windows.state(KEY, "gw-1")[0] == "off"
    assert feed(windows, "gw-1", even, 50.0, 60.0) == ["fine"]
    assert not windows.off() and windows.state(KEY, "gw-1")[0] == "verified"


def test_each_instance_is_judged_on_its_own() -> None:
    r = route(1, 1)
    windows = SplitWindows()
    windows.route_changed(KEY, r, 0.0)
    for t in (10.0, 20.0):
        windows.add(KEY, "gw-1", {"worker-a": 1000, "worker-b": 1000}, t, t + 10)
        windows.add(KEY, "gw-2", {"worker-a": 1800, "worker-b": 200}, t, t + 10)
        windows.judge_due(t + 10)
    assert list(windows.off()) == [(KEY, "gw-2")]
    assert windows.state(KEY, "gw-1")[0] == "verified"


def test_only_intervals_that_began_after_the_confirmed_route_are_counted() -> None:
    windows = SplitWindows()
    windows.route_changed(KEY, route(1, 1), 0.0)
    assert feed(windows, "gw-1", {"worker-a": 900}, 10.0, 20.0) == []
    assert windows.state(KEY, "gw-1")[2] == 900
    windows.route_changed(KEY, route(9, 1), 25.0)
    assert windows.state(KEY, "gw-1")[2] == 0
    # Half of this interval was picked by the old route: it is not counted.
    assert feed(windows, "gw-1", {"worker-a": 1500, "worker-b": 600}, 20.0, 30.0) == []
    assert windows.state(KEY, "gw-1")[2] == 0
    assert feed(windows, "gw-1", {"worker-a": 1800, "worker-b": 200}, 30.0, 40.0) == ["fine"]


def test_a_drain_is_never_judged_by_picks_made_before_it_whenever_their_report_arrives() -> None:
    """Issue 27: the interval after a route change was skipped by the order reports were folded
    in, not by when they were counted. An Envoy's report sent before the drain was folded after it
    (and skipped), and the next one, which held the last picks of the drained backend, was
    judged: weight 0 but served. Only intervals that began after the confirmed drain count."""
    windows = SplitWindows()
    windows.route_changed(KEY, route(1, 1), 0.0)
    windows.add(KEY, "envoy", {"worker-a": 500, "worker-b": 500}, 5.0, 15.0)
    windows.route_changed(KEY, route(1, 0), 18.0)  # drained at 18 s; the next report holds 15-18 s's picks of b
    assert feed(windows, "envoy", {"worker-a": 900, "worker-b": 100}, 15.0, 25.0) == []
    for t in (25.0, 35.0):
        assert feed(windows, "envoy", {"worker-a": 2000}, t, t + 10) == ["fine"]
    assert not windows.off() and windows.state(KEY, "envoy")[0] == "verified"


def test_a_restarted_count_restarts_the_window_rather_than_misjudging() -> None:
    windows = SplitWindows()
    windows.route_changed(KEY, route(1, 1), 0.0)
    windows.add(KEY, "gw-1", {"worker-a": 1500}, 10.0, 20.0)
    windows.restart(KEY, "gw-1", 25.0)
    assert windows.state(KEY, "gw-1")[2] == 0
    windows.add(KEY, "gw-1", {"worker-a": 999}, 20.0, 30.0)  # began before the restart: not counted
    assert feed(windows, "gw-1", {"worker-a": 1000, "worker-b": 1000}, 30.0, 40.0) == ["fine"]


def test_a_quiet_map_is_judged_after_the_longest_window_with_the_minimum() -> None:
    windows = SplitWindows()
    windows.route_changed(KEY, route(1, 1), 0.0)
    assert feed(windows, "gw-1", {"worker-a": 60, "worker-b": 60}, 10.0, 20.0) == []
    assert feed(windows, "gw-1", {"worker-a": 60, "worker-b": 60}, 20.0, 10.0 + MAX_WINDOW_SECONDS) == ["fine"]
    # Too few even then: the window starts over instead of growing for ever.
    assert feed(windows, "gw-1", {"worker-a": 50, "worker-b": 50}, 10.0 + MAX_WINDOW_SECONDS, 20.0 + MAX_WINDOW_SECONDS) == []
    assert feed(windows, "gw-1", {"worker-a": 10}, 20.0 + MAX_WINDOW_SECONDS, 30.0 + 2 * MAX_WINDOW_SECONDS) == []
    assert windows.state(KEY, "gw-1")[2] == 0


def test_a_withdrawn_map_and_a_gone_instance_are_forgotten() -> None:
    windows = SplitWindows()
    windows.route_changed(KEY, route(1, 1), 0.0)
    windows.add(KEY, "gw-1", {}, None, 10.0)
    windows.add(KEY, "gw-2", {}, None, 10.0)
    windows.forget_instance("gw-2")
    assert windows.state(KEY, "gw-2") == ("few_requests", None, 0)
    windows.route_changed(KEY, None, 15.0)
    windows.add(KEY, "gw-1", {"worker-a": 5000}, 10.0, 20.0)
    assert windows.judge_due(20.0) == []
