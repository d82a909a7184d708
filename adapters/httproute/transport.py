"""The Gateway API gateway's transport: it server-side applies object groups a bounded number at
a time, reads the gateway's verdict from route status, collects what maps left (weights to 0,
route, Services) and reads back what our objects serve. It never touches an object without our
labels (OME's own `<isvc>-global` route included), and does all Kubernetes I/O through
publisher.kube.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import aiohttp

from adapters.base import AdapterError, Rejected, TransportDefaults, Unavailable, WriteResult
from adapters.httproute.objects import MapObjects, ObjectName, object_name, serves, service_spec, take_verdict
from adapters.httproute.options import HttpRouteOptions
from adapters.httproute.render import (
    INSTANCE_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    UNKNOWN_ROUTE,
    BackendRef,
    ObjectGroup,
    is_ours,
    map_of,
    parse_route,
    render_route,
    render_service,
    route_verdict,
)
from adapters.timeouts import unit_duration
from publisher.kube import HTTP_ROUTES, SERVICES, Kube, KubeError
from publisher.core.model import Held, MapKey, Reason, Route

# The logger name JSON logs print, as before the gateway became a package.
log = logging.getLogger("adapters.httproute")

ALL_ZERO_NOTE = "every weight is 0: Gateway API answers this host with HTTP 500, not 503"
NOT_REPORTED_NOTE = "the gateway has not reported on the route yet"

# Requests in flight at once: enough to hide the API server's latency at start (10,000 maps), few
# enough to stay well inside API Priority and Fairness' default share for one client.
_CONCURRENCY = 32
# Up to this many routes are looked at one GET each; more, and one list of them all is cheaper.
_GET_LIMIT = 32
# How often a route's status is read while waiting for the gateway controller to report on it:
# the first look soon (a healthy controller reconciles in well under a second), then less often.
_STATUS_POLL_SECONDS = 0.05
_STATUS_POLL_MAX_SECONDS = 1.0
_PAGE = 500  # list page size, as kubectl's
_PARSE_BATCH = 100  # objects read back between two yields to the event loop (about 15 ms of parsing)

_R = TypeVar("_R")


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """The one place Kubernetes errors become adapter errors: refusals of an object are Rejected
    (the caller pins them on its map), everything a retry may fix is Unavailable."""
    try:
        yield
    except KubeError as exc:
        if exc.code in (400, 404, 422):
            raise Rejected(f"{what}: {exc.reason or exc.code}: {exc.message}") from exc
        raise Unavailable(f"{what}: {exc}") from exc


class HttpRouteTransport(TransportDefaults):
    """Object groups onto the gateway's cluster. `read()` once before the first `write()`: it learns
    which objects are ours, so a write sends only what differs."""

    def __init__(self, options: HttpRouteOptions, kube: Kube | None = None) -> None:
        self._options = options
        self._kube = kube
        self._own_kube = kube is None
        self._limit = asyncio.Semaphore(_CONCURRENCY)
        self._held: dict[MapKey, MapObjects] = {}
        self._owners: dict[ObjectName, MapKey] = {}  # our routes (and names being claimed) -> their map
        self._orphans: set[MapKey] = set()  # maps with Services of ours but no route, as last read
        self._told_timeouts_dropped = False

    async def _connected(self) -> Kube:
        if self._kube is None:
            async with _translated("cannot connect to the gateway's cluster"):
                self._kube = await Kube.connect(self._options.gateway_kubeconfig)
        return self._kube

    async def _call(self, what: str, call: Callable[[], Awaitable[_R]]) -> _R:
        """One API request, within the concurrency bound, its errors translated."""
        async with self._limit, _translated(what):
            return await call()

    async def _pages(self, resource: Any, selector: str | None) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        """Every object of `resource` in our namespace(s) matching `selector`, a page at a time
        (never all of them in memory at once), each with the list's resourceVersion."""
        kube, namespace = await self._connected(), self._options.route_namespace
        token: str | None = None
        while True:
            page = await self._call(
                f"cannot list {resource.plural}",
                lambda: kube.list(resource, namespace=namespace, label_selector=selector, limit=_PAGE, continue_token=token),
            )
            metadata = page.get("metadata") or {}
            yield page.get("items") or [], str(metadata.get("resourceVersion", ""))
            token = metadata.get("continue")
            if not token:
                return

    @property
    def _selector(self) -> str:
        return f"{MANAGED_BY_LABEL}={MANAGED_BY},{INSTANCE_LABEL}={self._options.region}"

    # --- read -------------------------------------------------------------------------------------

    async def read(self) -> dict[MapKey, Route]:
        """What our routes serve, for every map with a route of ours: hostname and weights as the
        route has them (edited by hand or not), when the route and every Service it points at are
        otherwise exactly as we render them and the gateway has not refused the route; else
        UNKNOWN_ROUTE. Everything of ours is remembered for the next write."""
        options = self._options
        held: dict[MapKey, MapObjects] = {}
        owners: dict[ObjectName, MapKey] = {}
        # Parsed a page at a time, with a pause now and then: 10,000 maps are 50,000 objects, seconds
        # of parsing that must not hold the event loop.
        async for routes, _ in self._pages(HTTP_ROUTES, self._selector):
            for count, route in enumerate(routes, 1):
                metadata = route["metadata"]
                key = map_of(route, options.region)
                if key is None:
                    log.warning("unreadable route left alone", extra={"route": f"{metadata['namespace']}/{metadata['name']}"})
                    continue
                try:
                    group, exact = parse_route(route, options)
                except (KeyError, ValueError, TypeError):
                    group, exact = None, False
                refused = isinstance(route_verdict(route, options), Held)
                held[key], owners[object_name(route)] = MapObjects(object_name(route), group, exact, refused), key
                if count % _PARSE_BATCH == 0:
                    await asyncio.sleep(0)
        async for services, _ in self._pages(SERVICES, self._selector):
            for count, service in enumerate(services, 1):
                key = map_of(service, options.region)
                if key is None:
                    log.warning("unreadable service left alone", extra={"service": "/".join(object_name(service))})
                    continue
                state = held.setdefault(key, MapObjects())
                state.services[object_name(service)] = service_spec(service, state.group, options)
                if count % _PARSE_BATCH == 0:
                    await asyncio.sleep(0)
        self._held, self._owners = held, owners
        self._orphans = {key for key, state in held.items() if state.route is None}
        return {key: state.group.served if serves(state) else UNKNOWN_ROUTE for key, state in held.items() if state.route is not None}

    # --- write ------------------------------------------------------------------------------------

    async def write(self, parts: Mapping[MapKey, ObjectGroup], changes: Mapping[MapKey, ObjectGroup | None]) -> WriteResult:
        """Withdrawals first (a hostname a map let go of is free before another map takes it),
        then every changed map, a bounded number at a time; then the gateway's verdicts. Services
        of ours whose map has no route and is not in `parts` are collected too."""
        await self._connected()
        orphans = [k for k in self._orphans if k not in parts and k not in changes]
        withdrawals = sorted([k for k, group in changes.items() if group is None] + orphans)
        withdrawn = await self._each(withdrawals, self._withdraw)
        self._orphans.clear()
        rejected: dict[MapKey, str | Held] = {k: str(o) for k, o in withdrawn.items() if isinstance(o, Rejected)}
        publish = {k: group for k, group in sorted(changes.items()) if group is not None}
        rejected.update(await self._claim(publish))
        written = await self._each([k for k in publish if k not in rejected], lambda k: self._publish(publish[k]))
        routes: dict[MapKey, Mapping[str, Any]] = {}
        for key, outcome in written.items():
            if isinstance(outcome, Rejected):
                rejected[key] = str(outcome)
            elif outcome is not None:
                routes[key] = outcome
        notes: dict[MapKey, str] = {}
        for key, verdict in (await self._verdicts(routes)).items():
            self._held[key].refused = isinstance(verdict, Held)
            if isinstance(verdict, Held):
                rejected[key] = verdict
            elif verdict is None:
                notes[key] = NOT_REPORTED_NOTE
        for key, group in publish.items():
            if group.all_zero and key not in rejected:
                notes[key] = "; ".join([*([notes[key]] if key in notes else []), ALL_ZERO_NOTE])
        return WriteResult(rejected=rejected, notes=notes)

    async def _each(self, keys: Iterable[MapKey], work: Callable[[MapKey], Awaitable[_R]]) -> dict[MapKey, _R | Rejected]:
        """`work` for every key, _CONCURRENCY maps at a time. A Rejected is that map's outcome; the
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

        await asyncio.gather(*(worker() for _ in range(_CONCURRENCY)))
        if failures:
            raise failures[0]
        return outcomes

    async def _claim(self, publish: Mapping[MapKey, ObjectGroup]) -> dict[MapKey, str | Held]:
        """Refusals of maps whose route name is taken: by another map of ours (the first key in
        order keeps a name two maps ask for at once), or by a route without our labels. A name we
        hold no route of ours under is looked up: one GET each for a few, one list for many."""
        rejected: dict[MapKey, str | Held] = {}
        lookup: list[MapKey] = []
        for key, group in publish.items():
            name = (group.namespace, group.route)
            owner = self._owners.get(name)
            if owner is None:
                self._owners[name] = key
                lookup.append(key)
            elif owner != key:
                rejected[key] = Held(Reason.CLAIM_REJECTED, f"route {name[0]}/{name[1]} already publishes {owner}")
        if not lookup:
            return rejected
        names = {(publish[k].namespace, publish[k].route) for k in lookup}
        existing: dict[ObjectName, Mapping[str, Any]] = {}
        if len(lookup) <= _GET_LIMIT:
            found = await _all(self._get_route(name) for name in names)
            existing = {object_name(route): route for route in found if route is not None}
        else:
            async for routes, _ in self._pages(HTTP_ROUTES, None):
                existing.update((object_name(route), route) for route in routes if object_name(route) in names)
        for key in lookup:
            name = (publish[key].namespace, publish[key].route)
            route = existing.get(name)
            if route is None:
                continue
            where = f"route {name[0]}/{name[1]}"
            if not is_ours(route, self._options.region):
                problem = f"{where} exists without this publisher's labels; it is left untouched"
            elif (owner := map_of(route, self._options.region)) != key:
                problem = f"{where} already publishes {owner or 'an unreadable map'}"
            else:
                continue  # ours for this map, written since we last read: the apply takes it as it is
            del self._owners[name]
            rejected[key] = Held(Reason.CLAIM_REJECTED, problem)
        return rejected

    async def _get_route(self, name: ObjectName) -> dict[str, Any] | None:
        kube = await self._connected()
        try:
            return await self._call(f"cannot read route {name[0]}/{name[1]}", lambda: kube.get(HTTP_ROUTES, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return None
            raise Unavailable(str(exc)) from exc

    async def _publish(self, group: ObjectGroup) -> Mapping[str, Any] | None:
        """Services first (so the route's refs resolve), then the route, then what it no longer
        uses: a route of ours under another name (other options since we last ran; no weights to 0
        first, as the new route already serves the host) and Services it dropped. Returns the route
        as the server answered, when it was written or its last verdict was a refusal."""
        kube, options = await self._connected(), self._options
        state = self._held.setdefault(group.key, MapObjects())
        wanted = {(group.namespace, ref.service): ref for ref in group.refs}

        async def apply_service(name: ObjectName, ref: BackendRef) -> None:
            body = render_service(group, ref, options)
            await self._call(f"service {name[0]}/{name[1]}", lambda: kube.apply(SERVICES, body, field_manager=options.field_manager))
            state.services[name] = (ref.cluster, ref.external_name)

        stale_services = [
            (name, ref) for name, ref in wanted.items() if state.services.get(name) != (ref.cluster, ref.external_name)
        ]
        await _all(apply_service(name, ref) for name, ref in stale_services)
        route = None
        target = (group.namespace, group.route)
        if state.route != target or not state.exact or state.group != group:
            body = render_route(group, options)
            route = await self._call(
                f"route {target[0]}/{target[1]}", lambda: kube.apply(HTTP_ROUTES, body, field_manager=options.field_manager)
            )
            self._check_timeouts_kept(route)
            if state.route not in (None, target):
                await self._delete(HTTP_ROUTES, state.route)
                self._owners.pop(state.route, None)
            state.route, state.group, state.exact = target, group, True
            self._owners[target] = group.key
        elif state.refused:
            route = await self._get_route(target)  # unchanged, but refused last time: ask again
        await _all(self._delete_service(state, name) for name in list(state.services) if name not in wanted)
        return route

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
        state = self._held.get(key)
        if state is None:
            return
        if state.route is not None:
            if state.group is not None and not state.group.all_zero:
                body = render_route(state.group.zeroed(), self._options)
                kube, manager = await self._connected(), self._options.field_manager
                await self._call(f"route {state.route[0]}/{state.route[1]}", lambda: kube.apply(HTTP_ROUTES, body, field_manager=manager))
                state.group = state.group.zeroed()
            await self._delete(HTTP_ROUTES, state.route)
            log.info("route withdrawn", extra={"map": str(key), "route": "/".join(state.route)})
            self._owners.pop(state.route, None)
            state.route = state.group = None
        await _all(self._delete_service(state, name) for name in list(state.services))
        del self._held[key]

    async def _delete_service(self, state: MapObjects, name: ObjectName) -> None:
        await self._delete(SERVICES, name)
        del state.services[name]

    async def _delete(self, resource: Any, name: ObjectName) -> None:
        kube = await self._connected()
        try:
            await self._call(f"cannot delete {resource.kind} {name[0]}/{name[1]}", lambda: kube.delete(resource, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return
            # A withdrawal has no map to pin a refusal on: retry it with the whole write.
            raise Unavailable(str(exc)) from exc

    async def _verdicts(self, routes: Mapping[MapKey, Mapping[str, Any]]) -> dict[MapKey, Held | bool | None]:
        """Each written route's verdict; waits up to route_status_timeout for the gateway to report
        on the rest: a GET of each now and then when few are left, one list and a watch from it
        when many are (a poll of thousands of routes would cost a list of them each time)."""
        options = self._options
        verdicts = {key: route_verdict(route, options) for key, route in routes.items()}
        waiting = {object_name(route): key for key, route in routes.items() if verdicts[key] is None}
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
                found = await _all(self._get_route(name) for name in waiting)
            except AdapterError:
                continue  # a failed read leaves them unreported; the note says so
            for route in found:
                if route is not None:
                    take_verdict(verdicts, waiting, route, options)
        return verdicts

    async def _watch_verdicts(self, verdicts: dict[MapKey, Held | bool | None], waiting: dict[ObjectName, MapKey]) -> None:
        """Verdicts from one list of our routes, then from a watch of them, until none is waiting."""
        options, kube = self._options, await self._connected()
        version = ""
        async for routes, version in self._pages(HTTP_ROUTES, self._selector):
            for route in routes:
                take_verdict(verdicts, waiting, route, options)
        if not waiting:
            return
        watch = kube.watch(
            HTTP_ROUTES,
            namespace=options.route_namespace,
            resource_version=version,
            label_selector=self._selector,
            timeout_seconds=int(options.route_status_timeout) + 1,
        )
        async with watch as stream:
            while waiting:
                line = await stream.readline()
                if not line:
                    return
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    take_verdict(verdicts, waiting, event["object"], options)

    async def aclose(self) -> None:
        if self._own_kube and self._kube is not None:
            await self._kube.close()
            self._kube = None



async def _all(coros: Iterable[Awaitable[_R]]) -> list[_R]:
    """Await them together; once all are done, raise the first failure (Unavailable before
    Rejected, so a retryable failure is never pinned on the map)."""
    outcomes = await asyncio.gather(*coros, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise next((f for f in failures if not isinstance(f, Rejected)), failures[0])
    return outcomes  # type: ignore[return-value]  # no failures: every outcome is an _R
