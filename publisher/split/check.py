"""Live split verification: does each gateway instance split requests as the weights say?

The gateway counts (adapters.base.RequestCounter: Envoy's Load Reporting Service, NGINX's pick-time
counters); this module owns the windows those counts fill (publisher.split.stats), judges them every
interval, and says what it found: per map and instance in /debug/maps, as the map's condition
message while it is off, and as metrics. It never holds, unpublishes or changes a map.

One task (`run`) drives it. The applier tells it, through `route_confirmed`, each route the
gateway confirmed, so the windows of a map restart when its weights change. Each report's interval
runs from the instance's previous report to this one, so a window counts only the picks made after
its route was confirmed (publisher.split.stats).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from adapters.base import AdapterError, RequestCounter
from publisher.core.values import MapKey, Route
from publisher.split.stats import Judgment, SplitWindows, describe

log = logging.getLogger("publisher.served_split")

# Maps (or windows) a fold handles between two yields to the event loop: about 7 ms of judging.
SLICE = 500


class SplitVerifier:
    """`changed(key)` is called when a map's off-state flips, so its condition message follows."""

    def __init__(self, counter: RequestCounter, interval: float, gateway: str, changed: Callable[[MapKey], None]) -> None:
        self.counter = counter
        self.interval = interval
        self.gateway = gateway
        self.changed = changed
        self.windows = SplitWindows()
        self.folded: Counter[str] = Counter()
        self.instances: set[str] = set()
        self.fold_seconds = 0.0
        self.map_states: Counter[str] = Counter()
        self._routes: dict[MapKey, Route] = {}
        self._off: dict[MapKey, str] = {}
        # Each instance's last report time: the start of its next interval.
        self._since: dict[str, float] = {}
        self.clock: Callable[[], float] = time.monotonic

    # --- what the applier tells it -------------------------------------------------------------

    def route_confirmed(self, key: MapKey, route: Route | None) -> None:
        if route is None:
            self._routes.pop(key, None)
            if self._off.pop(key, None) is not None:
                self.changed(key)
        else:
            self._routes[key] = route
        self.windows.route_changed(key, route, self.clock())

    # --- the task ---------------------------------------------------------------------------------

    async def run(self) -> None:
        self.counter.enable(self.interval)
        while True:
            await asyncio.sleep(self.interval)
            try:
                batch = await self.counter.collect()
            except AdapterError as exc:
                log.warning("request counts not read", extra={"gateway": self.gateway, "error": str(exc)})
                continue
            await self.fold(batch, self.clock())

    async def fold(self, batch: list[Any], now: float) -> None:
        """Add one round of request counts, judge what is due, and say which maps turned off or back.

        In slices of `SLICE` maps or windows, yielding between: at 10,000 busy maps one round
        held the event loop 160 ms (judging every map), and every change waited behind it. A
        route the applier confirms meanwhile restarts its windows as at any other time."""
        started = time.perf_counter()

        async def pause() -> None:
            nonlocal started
            self.fold_seconds += time.perf_counter() - started
            await asyncio.sleep(0)
            started = time.perf_counter()

        for counted in batch:
            instance, at = counted.instance, now if counted.at is None else counted.at
            if counted.restarted or counted.left:
                self.windows.forget_instance(instance)
            if counted.left:
                # Its series go with it: Envoys that reconnect under new labels must not grow them.
                self.instances.discard(instance)
                self.folded.pop(instance, None)
                self._since.pop(instance, None)
                continue
            self.instances.add(instance)
            if not counted.restarted:
                self.folded[instance] += 1
            for key in counted.recounted:
                self.windows.restart(key, instance, at)
            start = self._since.get(instance)
            for done, (key, counts) in enumerate(counted.counts.items(), 1):
                self.windows.add(key, instance, counts, start, at)
                if done % SLICE == 0:
                    await pause()
            self._since[instance] = at
        due = self.windows.due(now)
        for start in range(0, len(due), SLICE):
            if start:
                await pause()
            self.windows.judge(due[start : start + SLICE], len(due))
        await pause()
        off: dict[MapKey, str] = {}
        for (key, instance), judgment in sorted(self.windows.off().items()):
            route = self._routes.get(key)
            if route is not None and key not in off:
                off[key] = describe(judgment, route, f"{self.gateway} {instance}")
        for key in set(off) | set(self._off):
            if off.get(key) != self._off.get(key):
                if key in off:
                    log.warning("served split off", extra={"map": str(key), "detail": off[key]})
                else:
                    log.info("served split verified again", extra={"map": str(key)})
                self.changed(key)
        self._off = off
        # Only maps with a window can be anything but few_requests: O(counted maps), not O(maps).
        states: Counter[str] = Counter()
        for done, key in enumerate(self.windows.maps(), 1):
            if key in self._routes:
                states[self._map_state(key)] += 1
            if done % SLICE == 0:
                await pause()
        uncounted = len(self._routes) - sum(states.values())
        if uncounted:
            states["few_requests"] += uncounted
        self.map_states = states
        self.fold_seconds += time.perf_counter() - started

    def _map_state(self, key: MapKey) -> str:
        if key in self._off:
            return "off"
        states = [self.windows.state(key, instance)[0] for instance in self.instances]
        return "verified" if states and all(s == "verified" for s in states) else "few_requests"

    # --- what it says -----------------------------------------------------------------------------

    def note(self, key: MapKey) -> str | None:
        """The condition message's note while the map's served split is off on some instance."""
        return self._off.get(key)

    def off(self) -> list[tuple[MapKey, str]]:
        return sorted(self.windows.off())

    def debug(self, key: MapKey) -> dict[str, Any]:
        """Each instance's window, for /debug/maps."""
        route = self._routes.get(key)
        instances = {}
        for instance in sorted(self.instances):
            verdict, judgment, counted = self.windows.state(key, instance)
            instances[instance] = _window_view(verdict, judgment, counted)
        return {"gateway": self.gateway, "route": route is not None, "instances": instances}


def _window_view(verdict: str, judgment: Judgment | None, counted: int) -> dict[str, Any]:
    view: dict[str, Any] = {"verdict": verdict, "counting": counted}
    if judgment is not None:
        view.update(
            requests=judgment.requests,
            observed={c: round(s, 4) for c, s in judgment.observed.items()},
            expected={c: round(s, 4) for c, s in judgment.expected.items()},
            pValue=judgment.p_value,
            largestDeviation=round(judgment.largest_deviation, 4),
            detail=judgment.why or None,
        )
    return view


def unsupported(adapter: str) -> dict[str, Any]:
    return {"gateway": adapter, "verdict": "unsupported", "detail": f"the {adapter} gateway reports no request counts"}
