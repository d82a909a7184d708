"""Is the split a gateway serves the split we published? Pure statistics over counted requests.

A gateway instance reports, per interval, how many requests each of a map's backends got, counted
when the backend was picked (a request's start), never when it ended: an LLM stream picked before a
drain may end minutes after it. Those counts are folded into a tumbling window per (map, instance)
and judged against the route's weights once the window holds enough requests. A window counts only
intervals that began after the map's route was confirmed (and `REPORT_LAG` more), so no pick made
under the old weights is judged against the new. Envoy draws every request independently, so one
map's counts in a window are multinomial; NGINX's smooth weighted round robin spreads them far more
evenly, so a multinomial test is conservative there. Maps are judged one by one, never pooled: the
first picks after a reset of round robin favour the heavy backends.

The rule (simulated over 10,000 maps x 100 windows of correct gateways: no false alarm):
- a backend of weight 0 that got any request is off at once;
- under `MIN_REQUESTS` requests there is no verdict;
- otherwise the window is off when the chi-square p-value is below `FAMILY_ALPHA / maps judged
  that round` (a Bonferroni bound over the round) and some backend is more than `MIN_DEVIATION`
  from its share: a large gateway must not raise alarms on noise, and a tiny skew is not worth one;
- a map is reported off after `CONFIRMATIONS` off windows in a row, and cleared by the first fine
  one: a false alarm lasts no longer than it took to raise.

This is a report: no verdict here ever holds, unpublishes or changes a map.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from publisher.core.values import MapKey, Route

MIN_REQUESTS = 200
ENOUGH_REQUESTS = 2000
MAX_WINDOW_SECONDS = 15 * 60.0
FAMILY_ALPHA = 1e-3
MIN_DEVIATION = 0.05
CONFIRMATIONS = 2
# How late a count may reach the sidecar after the gateway took it (an Envoy's load report is sent
# before it arrives): an interval that began less than this after a route was confirmed may hold
# picks made under the old route, so it is not counted.
REPORT_LAG = 1.0

Verdict = Literal["fine", "off", "few_requests"]


def chi_square_survival(statistic: float, degrees: int) -> float:
    """P(X >= statistic) for X chi-square with `degrees` degrees of freedom: the regularised upper
    incomplete gamma function Q(degrees / 2, statistic / 2)."""
    if degrees <= 0:
        raise ValueError("degrees of freedom must be positive")
    a, x = degrees / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        # The lower function's power series converges fast here; Q is its complement.
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1.0
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    # Beyond the mean, Q's continued fraction converges fast and keeps tiny p-values exact
    # (modified Lentz evaluation).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    i = 0
    while True:
        i += 1
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        step = d * c
        h *= step
        if abs(step - 1.0) < 1e-15 or i > 10_000:
            break
    return min(1.0, math.exp(log_prefix) * h)


@dataclass(frozen=True, slots=True)
class Judgment:
    """One window of one map on one gateway instance, judged."""

    verdict: Verdict
    requests: int
    observed: Mapping[str, float]
    expected: Mapping[str, float]
    p_value: float | None = None
    largest_deviation: float = 0.0
    why: str = ""


def expected_shares(route: Route) -> dict[str, float]:
    total = sum(b.weight for b in route.backends)
    return {b.cluster: (b.weight / total if total else 0.0) for b in route.backends}


def judge(counts: Mapping[str, int], route: Route, maps_judged: int) -> Judgment:
    """Judge one window's counts per backend cluster against the route's weights. `maps_judged`
    is how many map windows are judged in the same round (the Bonferroni divisor)."""
    requests = sum(counts.get(b.cluster, 0) for b in route.backends)
    expected = expected_shares(route)
    observed = {b.cluster: (counts.get(b.cluster, 0) / requests if requests else 0.0) for b in route.backends}
    deviation = max((abs(observed[c] - expected[c]) for c in expected), default=0.0)
    drained = [b.cluster for b in route.backends if b.weight == 0 and counts.get(b.cluster, 0) > 0]
    if drained:
        return Judgment("off", requests, observed, expected, 0.0, deviation, f"weight 0 but served: {', '.join(drained)}")
    if requests < MIN_REQUESTS:
        return Judgment("few_requests", requests, observed, expected, None, deviation, f"few requests ({requests} of {MIN_REQUESTS})")
    live = [b for b in route.backends if b.weight > 0]
    if len(live) < 2:
        return Judgment("fine", requests, observed, expected, 1.0, deviation)
    statistic = 0.0
    for b in live:
        want = expected[b.cluster] * requests
        got = counts.get(b.cluster, 0)
        statistic += (got - want) ** 2 / want
    p_value = chi_square_survival(statistic, len(live) - 1)
    if p_value < FAMILY_ALPHA / max(1, maps_judged) and deviation > MIN_DEVIATION:
        return Judgment("off", requests, observed, expected, p_value, deviation, "served split differs from the weights")
    return Judgment("fine", requests, observed, expected, p_value, deviation)


def describe(judgment: Judgment, route: Route, gateway: str) -> str:
    """The condition message for a map whose served split is off on one gateway instance."""
    shares = ", ".join(f"{c} {round(100 * s)}%" for c, s in judgment.observed.items())
    weights = "/".join(str(b.weight) for b in route.backends)
    return f"served split on {gateway} over {judgment.requests:,} requests: {shares} (weights {weights})"


@dataclass(slots=True)
class _Window:
    route: Route
    # Only intervals that began at or after this are counted (time.monotonic()).
    counting_from: float
    counts: dict[str, int] = field(default_factory=dict)
    opened: float | None = None
    off_streak: int = 0
    reported_off: bool = False
    verified: bool = False
    last: Judgment | None = None
    last_off: Judgment | None = None

    def restart(self, counting_from: float) -> None:
        self.counts.clear()
        self.opened = None
        self.counting_from = max(self.counting_from, counting_from)


WindowKey = tuple[MapKey, str]


class SplitWindows:
    """Tumbling windows per (map, gateway instance) and the in-a-row rule. Owned by one task.

    `route_changed` is called when the engine confirms a write that changes a map's route: its
    windows restart, and count only intervals that begin `REPORT_LAG` after it (the interval that
    holds the change mixes both routes, and Envoy reports a new cluster only from its second
    report). `restart` starts one window over (its instance's count of that map started over: a
    new boot or stream, an evicted counter) from the given time. Windows are kept per map, so a
    route change costs its map's windows, not every map's."""

    def __init__(self, enough: int = ENOUGH_REQUESTS, max_age: float = MAX_WINDOW_SECONDS) -> None:
        self.enough = enough
        self.max_age = max_age
        self._routes: dict[MapKey, tuple[Route, float]] = {}
        self._windows: dict[MapKey, dict[str, _Window]] = {}

    def route_changed(self, key: MapKey, route: Route | None, now: float) -> None:
        if route is None:
            self._routes.pop(key, None)
            self._windows.pop(key, None)
            return
        counting_from = now + REPORT_LAG
        self._routes[key] = (route, counting_from)
        for window in self._windows.get(key, {}).values():
            window.route = route
            window.restart(counting_from)

    def restart(self, key: MapKey, instance: str, now: float) -> None:
        """This instance's count of this map started over at `now`: what was counted before is
        not, and no verdict stands until a window after it is judged (as when the whole instance
        starts over)."""
        known = self._routes.get(key)
        if known is not None:
            self._windows.setdefault(key, {})[instance] = _Window(known[0], max(known[1], now))

    def add(self, key: MapKey, instance: str, counts: Mapping[str, int], start: float | None, end: float) -> None:
        """One reported interval (`start`, `end`] of picks per backend cluster for one map on one
        instance. `start` None: not known (an instance's first report), so not counted."""
        window = self._window(key, instance)
        if window is None or start is None or start < window.counting_from:
            return
        if window.opened is None:
            window.opened = start
        for cluster, n in counts.items():
            if n:
                window.counts[cluster] = window.counts.get(cluster, 0) + n

    def _window(self, key: MapKey, instance: str) -> _Window | None:
        known = self._routes.get(key)
        if known is None:
            return None
        windows = self._windows.setdefault(key, {})
        window = windows.get(instance)
        if window is None:
            window = windows[instance] = _Window(*known)
        return window

    def maps(self) -> set[MapKey]:
        """The maps with a window on some instance."""
        return {key for key, windows in self._windows.items() if windows}

    def forget_instance(self, instance: str) -> None:
        for windows in self._windows.values():
            windows.pop(instance, None)

    def _items(self) -> Iterator[tuple[WindowKey, _Window]]:
        for key, windows in self._windows.items():
            for instance, window in windows.items():
                yield (key, instance), window

    def due(self, now: float) -> list[WindowKey]:
        """The windows ready to judge: enough requests, or old enough with at least the minimum,
        or holding a request to a weight-0 backend."""
        ready = []
        for wkey, window in self._items():
            if window.opened is None:
                continue
            n = sum(window.counts.values())
            old = now - window.opened >= self.max_age
            drained = any(b.weight == 0 and window.counts.get(b.cluster, 0) for b in window.route.backends)
            if n >= self.enough or drained or (old and n >= MIN_REQUESTS):
                ready.append(wkey)
            elif old:
                window.counts.clear()
                window.opened = now
        return ready

    def judge(self, wkeys: Iterable[WindowKey], maps_judged: int) -> list[tuple[MapKey, str, Judgment]]:
        """Judge these windows of a round of `maps_judged` (the Bonferroni bound's count), apply
        the in-a-row rule, and start each one over. A window restarted since it was found due (its
        route changed, its instance left) is not judged."""
        judged = []
        for key, instance in wkeys:
            window = self._windows.get(key, {}).get(instance)
            if window is None or window.opened is None:
                continue
            judgment = judge(window.counts, window.route, maps_judged)
            window.last = judgment
            if judgment.verdict == "off":
                window.last_off = judgment
                window.off_streak += 1
                if window.off_streak >= CONFIRMATIONS:
                    window.reported_off = True
                    window.verified = False
            elif judgment.verdict == "fine":
                window.off_streak = 0
                window.reported_off = False
                window.verified = True
            window.counts.clear()
            window.opened = None
            judged.append((key, instance, judgment))
        return judged

    def judge_due(self, now: float) -> list[tuple[MapKey, str, Judgment]]:
        """Judge every due window at once (SplitVerifier judges them in slices)."""
        ready = self.due(now)
        return self.judge(ready, len(ready))

    def off(self) -> dict[WindowKey, Judgment]:
        """Each (map, instance) now reported off, with the judgment that last said so."""
        return {k: w.last_off for k, w in self._items() if w.reported_off and w.last_off is not None}

    def state(self, key: MapKey, instance: str) -> tuple[str, Judgment | None, int]:
        """verified | off | few_requests (no verdict yet), the last judgment, and the requests
        counted in the open window."""
        window = self._windows.get(key, {}).get(instance)
        if window is None:
            return "few_requests", None, 0
        counted = sum(window.counts.values())
        if window.reported_off:
            return "off", window.last, counted
        if window.verified:
            return "verified", window.last, counted
        return "few_requests", window.last, counted
