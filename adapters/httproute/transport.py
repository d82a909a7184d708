"""The Gateway API gateway's transport: it server-side applies object groups a bounded number at
a time, reads the gateway's verdict from route status, collects what maps left (weights to 0,
route, Services) and reads back what our objects serve. It never touches an object without our
labels (OME's own `<isvc>-global` route included), and does all Kubernetes I/O through
publisher.kube (cluster.py). What is ours and what a write must do is OwnedObjects' (owned.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import aiohttp

from adapters.base import AdapterError, Rejected, TransportDefaults, WriteResult
from adapters.httproute.cluster import CONCURRENCY, GatewayCluster, all_of
from adapters.httproute.options import HttpRouteOptions
from adapters.httproute.owned import ObjectName, OwnedObjects, object_name, take_verdict
from adapters.httproute.render import BackendRef, ObjectGroup, render_route, render_service, route_verdict
from adapters.timeouts import unit_duration
from publisher.kube import HTTP_ROUTES, SERVICES, Kube, KubeError
from publisher.core.values import Held, MapKey, Route

# The logger name JSON logs print, as before the gateway became a package.
log = logging.getLogger("adapters.httproute")

ALL_ZERO_NOTE = "every weight is 0: Gateway API answers this host with HTTP 500, not 503"
NOT_REPORTED_NOTE = "the gateway has not reported on the route yet"

# Up to this many routes are looked at one GET each; more, and one list of them all is cheaper.
_GET_LIMIT = 32
# How often a route's status is read while waiting for the gateway controller to report on it:
# the first look soon (a healthy controller reconciles in well under a second), then less often.
_STATUS_POLL_SECONDS = 0.05
_STATUS_POLL_MAX_SECONDS = 1.0
_SERVED_BATCH = 1000  # maps judged between two turns of the event loop (a few milliseconds)

_R = TypeVar("_R")
Verdict = Held | bool | None  # the gateway's word on a route: refused, taken, or not yet


class HttpRouteTransport(TransportDefaults):
    """Object groups onto the gateway's cluster. `read()` once before the first `write()`: it learns
    which objects are ours, so a write sends only what differs."""

    def __init__(self, options: HttpRouteOptions, kube: Kube | None = None) -> None:
        self._options = options
        self._cluster = GatewayCluster(options, kube)
        self._owned = OwnedObjects(options)
        self._told_timeouts_dropped = False

    # --- read -------------------------------------------------------------------------------------

    async def read(self) -> dict[MapKey, Route]:
        """What our routes serve, for every map with a route of ours: hostname and weights as the
        route has them (edited by hand or not), when the route and every Service it points at are
        otherwise exactly as we render them and the gateway has not refused the route; else
        UNKNOWN_ROUTE. Everything of ours is remembered for the next write."""
        owned = OwnedObjects(self._options)
        # A page at a time (cluster.PAGE objects, a few milliseconds of decoding and parsing), the
        # loop's turn between two: 10,000 maps are 50,000 objects, seconds of work that must not
        # hold the event loop. Of each object only the few fields a write needs are kept.
        async for routes, _ in self._cluster.pages(HTTP_ROUTES, self._cluster.selector):
            for route in routes:
                if owned.add_route(route) is None:
                    log.warning("unreadable route left alone", extra={"route": "/".join(object_name(route))})
            await asyncio.sleep(0)
        async for services, _ in self._cluster.pages(SERVICES, self._cluster.selector):
            for service in services:
                if owned.add_service(service) is None:
                    log.warning("unreadable service left alone", extra={"service": "/".join(object_name(service))})
            await asyncio.sleep(0)
        served: dict[MapKey, Route] = {}
        for count, (key, route) in enumerate(owned.served(), 1):
            served[key] = route
            if count % _SERVED_BATCH == 0:
                await asyncio.sleep(0)
        self._owned = owned
        return served

    # --- write ------------------------------------------------------------------------------------

    async def write(self, parts: Mapping[MapKey, ObjectGroup], changes: Mapping[MapKey, ObjectGroup | None]) -> WriteResult:
        """Withdrawals first (a hostname a map let go of is free before another map takes it),
        then every changed map, a bounded number at a time; then the gateway's verdicts. Services
        of ours whose map has no route and is not in `parts` are collected too."""
        await self._cluster.connected()
        withdrawn = await _each(self._owned.withdrawals(parts, changes), self._withdraw)
        self._owned.orphans_collected()
        rejected: dict[MapKey, str | Held] = {k: str(o) for k, o in withdrawn.items() if isinstance(o, Rejected)}
        publish = {k: group for k, group in sorted(changes.items()) if group is not None}
        rejected.update(await self._claim(publish))
        written = await _each([k for k in publish if k not in rejected], lambda k: self._publish(publish[k]))
        routes: dict[MapKey, tuple[ObjectName, Verdict]] = {}
        for key, outcome in written.items():
            if isinstance(outcome, Rejected):
                rejected[key] = str(outcome)
            elif outcome is not None:
                routes[key] = outcome
        notes: dict[MapKey, str] = {}
        for key, verdict in (await self._verdicts(routes)).items():
            self._owned.judged(key, verdict)
            if isinstance(verdict, Held):
                rejected[key] = verdict
            elif verdict is None:
                notes[key] = NOT_REPORTED_NOTE
        for key, group in publish.items():
            if group.all_zero and key not in rejected:
                notes[key] = "; ".join([*([notes[key]] if key in notes else []), ALL_ZERO_NOTE])
        return WriteResult(rejected=rejected, notes=notes)

    async def _claim(self, publish: Mapping[MapKey, ObjectGroup]) -> dict[MapKey, str | Held]:
        """Refusals of maps whose route name is taken (OwnedObjects.claim); a name we hold no route
        of ours under is looked up: one GET each for a few, one list for many."""
        claimed, lookup = self._owned.claim(publish)
        rejected: dict[MapKey, str | Held] = dict(claimed)
        names = {(publish[k].namespace, publish[k].route): k for k in lookup}
        if len(lookup) <= _GET_LIMIT:
            found = await all_of(self._cluster.get_route(name) for name in names)
            taken = {object_name(route): route for route in found if route is not None}
        else:  # only the routes under a claimed name are kept from the list
            taken = {}
            async for routes, _ in self._cluster.pages(HTTP_ROUTES, None):
                taken.update((object_name(route), route) for route in routes if object_name(route) in names)
        for name, key in names.items():
            if (refusal := self._owned.settle_claim(publish[key], taken.get(name))) is not None:
                rejected[key] = refusal
        return rejected

    async def _publish(self, group: ObjectGroup) -> tuple[ObjectName, Verdict] | None:
        """Services first (so the route's refs resolve), then the route, then what it no longer
        uses: a route of ours under another name (no weights to 0 first, as the new route already
        serves the host) and Services it dropped. Returns the route's name and the verdict it came
        back with, when it was written or its last verdict was a refusal."""
        cluster, owned = self._cluster, self._owned

        async def apply_service(name: ObjectName, ref: BackendRef) -> None:
            await cluster.apply(SERVICES, render_service(group, ref, self._options), f"service {name[0]}/{name[1]}")
            owned.service_written(group.key, name, ref)

        await all_of(apply_service(name, ref) for name, ref in owned.stale_services(group))
        route = None
        target = (group.namespace, group.route)
        if owned.route_stale(group):
            route = await cluster.apply(HTTP_ROUTES, render_route(group, self._options), f"route {target[0]}/{target[1]}")
            self._check_timeouts_kept(route)
            if (moved := owned.route_moved(group)) is not None:
                await cluster.delete(HTTP_ROUTES, moved)
            owned.route_written(group)
        elif owned.refused(group.key):
            route = await cluster.get_route(target)  # unchanged, but refused last time: ask again
        await all_of(self._delete_service(group.key, name) for name in owned.unused_services(group))
        # Only the verdict is kept of the route the server answered with, not the whole object.
        return None if route is None else (target, route_verdict(route, self._options))

    def _check_timeouts_kept(self, route: Mapping[str, Any] | None) -> None:
        """Logs once when the API server dropped the rules' `timeouts`: an HTTPRoute CRD older than
        Gateway API v1.2 (standard channel) does not know them. The gateway then keeps its own
        deadline (15 s in some), and each resync finds the route not as rendered and applies it again."""
        rules = ((route or {}).get("spec") or {}).get("rules") or []
        if route is None or self._told_timeouts_dropped or all("timeouts" in rule for rule in rules):
            return
        self._told_timeouts_dropped = True
        log.warning(
            "the API server dropped the HTTPRoute's timeouts: install Gateway API's CRDs v1.2 or later (standard channel)",
            extra={"route": "/".join(object_name(route)), "request_timeout": unit_duration(self._options.route_timeout)},
        )

    async def _withdraw(self, key: MapKey) -> None:
        """Safe order: the route's weights to 0 (no request can reach a Service we delete), then the
        route, then its Services."""
        withdrawal = self._owned.withdrawal(key)
        if withdrawal is None:
            return
        route, zeroed, services = withdrawal
        if route is not None:
            if zeroed is not None:
                await self._cluster.apply(HTTP_ROUTES, render_route(zeroed, self._options), f"route {route[0]}/{route[1]}")
                self._owned.route_zeroed(key)
            await self._cluster.delete(HTTP_ROUTES, route)
            log.info("route withdrawn", extra={"map": str(key), "route": "/".join(route)})
            self._owned.route_deleted(key)
        await all_of(self._delete_service(key, name) for name in services)
        self._owned.forget(key)

    async def _delete_service(self, key: MapKey, name: ObjectName) -> None:
        await self._cluster.delete(SERVICES, name)
        self._owned.service_deleted(key, name)

    # --- confirmation -----------------------------------------------------------------------------

    async def _verdicts(self, routes: Mapping[MapKey, tuple[ObjectName, Verdict]]) -> dict[MapKey, Verdict]:
        """Each written route's verdict; waits up to route_status_timeout for the gateway to report
        on the rest: a GET of each now and then when few are left, one list and a watch from it
        when many are (a poll of thousands of routes would cost a list of them each time)."""
        options = self._options
        verdicts = {key: verdict for key, (_, verdict) in routes.items()}
        waiting = {name: key for key, (name, verdict) in routes.items() if verdict is None}
        deadline = time.monotonic() + options.route_status_timeout
        if len(waiting) > _GET_LIMIT:
            # Any failure of the list or the stream leaves the rest unreported; the note says so.
            with contextlib.suppress(TimeoutError, AdapterError, KubeError, ValueError, aiohttp.ClientError):
                async with asyncio.timeout(options.route_status_timeout):
                    await self._watch_verdicts(verdicts, waiting)
            return verdicts  # what is still unreported after the timeout gets a note
        delay = _STATUS_POLL_SECONDS
        while waiting and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, _STATUS_POLL_MAX_SECONDS)
            try:
                found = await all_of(self._cluster.get_route(name) for name in waiting)
            except AdapterError:
                continue  # a failed read leaves them unreported; the note says so
            for route in found:
                if route is not None:
                    take_verdict(verdicts, waiting, route, options)
        return verdicts

    async def _watch_verdicts(self, verdicts: dict[MapKey, Verdict], waiting: dict[ObjectName, MapKey]) -> None:
        """Verdicts from one list of our routes, then from a watch of them, until none is waiting."""
        options = self._options
        version = ""
        async for routes, version in self._cluster.pages(HTTP_ROUTES, self._cluster.selector):
            for route in routes:
                take_verdict(verdicts, waiting, route, options)
        if not waiting:
            return
        async with self._cluster.watch_routes(version, options.route_status_timeout) as stream:
            while waiting:
                line = await stream.readline()
                if not line:
                    return
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    take_verdict(verdicts, waiting, event["object"], options)

    async def aclose(self) -> None:
        await self._cluster.aclose()


async def _each(keys: Iterable[MapKey], work: Callable[[MapKey], Awaitable[_R]]) -> dict[MapKey, _R | Rejected]:
    """`work` for every key, CONCURRENCY maps at a time. A Rejected is that map's outcome; the
    first other error stops taking new keys and is raised once the maps in flight are done."""
    queue = iter(keys)
    outcomes: dict[MapKey, _R | Rejected] = {}
    failures: list[Exception] = []

    async def worker() -> None:
        for key in queue:
            if failures:
                return
            try:
                outcomes[key] = await work(key)
            except Rejected as exc:
                outcomes[key] = exc
            except Exception as exc:  # raised below, once the other workers are done
                failures.append(exc)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    if failures:
        raise failures[0]
    return outcomes
