"""Envoy's xDS mode: the sidecar as a gRPC delta ADS server (grpc.aio, in the sidecar's event loop).

Owns the streams of every connected Envoy, what each one holds (resource name -> version, from its
ACKs and from the versions it lists on reconnect), and the order of updates: clusters ACKed before
the scope and route naming them, scopes removed before their clusters, one map per response in
steady state, a NACKed batch resent map by map to pin the refusal. It renders nothing (see
adapters.envoy_resources), decides nothing about maps and imports no metrics: per-Envoy state is
data (`envoys()`, read by publisher.metrics at scrape time; `served()`, for /debug/maps).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from adapters.base import Unavailable, WriteResult
from adapters.envoy_resources import (
    CLUSTER_TYPE,
    ROUTE_TYPE,
    SCOPE_TYPE,
    MapResources,
    Resource,
    XdsRenderer,
    key_of,
    map_name,
    route_from_version,
)
from publisher.model import MapKey, Route

log = logging.getLogger(__name__)

__all__ = ["EnvoyStatus", "XdsTransport"]

_KIND = {CLUSTER_TYPE: "cluster", SCOPE_TYPE: "scope", ROUTE_TYPE: "route"}
# Envoy lists every version it holds when it reconnects: about 2 MB at 10,000 maps.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
    # Pings find a dead Envoy (or a dead path to it) within about 30 s, on an idle stream too.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


@dataclass(frozen=True)
class EnvoyStatus:
    """One connected Envoy as operators see it.

    node: Envoy's node id; peer: its address. nacks: refusals since it connected, by resource kind
    (cluster, scope, route). unacked_since: monotonic time of the oldest change it has not ACKed,
    or None when it serves everything it was given. sent: resources added or removed on this stream.
    """

    node: str
    peer: str
    connected_at: float
    nacks: Mapping[str, int]
    unacked_since: float | None
    sent: int


@dataclass
class _Item:
    """One map's share of one response (for `part` of the target): resources to add or update,
    names to remove."""

    key: MapKey
    part: MapResources | None
    resources: tuple[Resource, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Posted:
    """A response queued for the stream: Envoy's answer (its error text, or None for an ACK),
    how many resources it carried, and how long its ACK may take."""

    answer: asyncio.Future[str | None]
    count: int
    timeout: float


def _batches(items: Iterable[_Item], size: int) -> Iterator[list[_Item]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class _Behind(Exception):
    """The Envoy did not answer a response in time: its stream is ended, and it reconnects."""


@dataclass(eq=False)
class _Session:
    """One Envoy's stream: what it holds, what it subscribed, and the one response in flight."""

    transport: XdsTransport
    peer: str
    node: str = ""
    connected_at: float = field(default_factory=time.monotonic)
    held: dict[str, dict[str, str]] = field(default_factory=lambda: {CLUSTER_TYPE: {}, SCOPE_TYPE: {}, ROUTE_TYPE: {}})
    clusters_of: dict[MapKey, set[str]] = field(default_factory=dict)
    subscribed: set[str] = field(default_factory=set)  # types Envoy asked for
    owed_first: set[str] = field(default_factory=set)  # types whose first request awaits an answer
    routes_wanted: set[str] = field(default_factory=set)  # RDS names Envoy subscribed
    dirty: set[MapKey] = field(default_factory=set)
    nacks: dict[MapKey, tuple[MapResources | None, str]] = field(default_factory=dict)
    nack_counts: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    synced: int = -1
    unacked_since: float | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    # Held by whoever brings this Envoy to the target: the session's own task (after a request,
    # a reconnect) or a write that found the session idle and converges it itself, without the
    # task switch a wake-up costs (about 1 ms at p50 and 10 ms at p99 on a busy loop).
    converging: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A bounded queue: the syncer puts one response and waits for its ACK, so at most one is
    # queued; everything else an Envoy is owed is the difference between the target and `held`,
    # recomputed, so a slow Envoy costs no memory per change, only one response's worth.
    outbox: asyncio.Queue[discovery_pb2.DeltaDiscoveryResponse | None] = field(default_factory=lambda: asyncio.Queue(maxsize=1))
    pending: tuple[str, asyncio.Future[str | None]] | None = None
    nonces: itertools.count[int] = field(default_factory=itertools.count)
    cut: str | None = None  # why the sidecar ended this stream

    @property
    def name(self) -> str:
        return f"{self.node}@{self.peer}"

    # --- what Envoy told us --------------------------------------------------------------------------

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        if request.node.id:
            self.node = request.node.id
        type_url = request.type_url
        if type_url not in _KIND:
            return
        if request.response_nonce:
            if self.pending is not None and self.pending[0] == request.response_nonce and not self.pending[1].done():
                self.pending[1].set_result(request.error_detail.message if request.HasField("error_detail") else None)
        for name, version in request.initial_resource_versions.items():
            self._hold(type_url, name, version)
        if type_url not in self.subscribed:
            self.subscribed.add(type_url)
            if type_url != ROUTE_TYPE:
                self.owed_first.add(type_url)
            self.dirty.update(self.transport._target)
            self.dirty.update(k for n in request.initial_resource_versions if (k := key_of(n)) is not None)
        if type_url == ROUTE_TYPE:
            for name in request.resource_names_subscribe:
                self.routes_wanted.add(name)
                if (key := key_of(name)) is not None:
                    self.dirty.add(key)
            for name in request.resource_names_unsubscribe:
                self.routes_wanted.discard(name)
                self.held[ROUTE_TYPE].pop(name, None)
        self.wake.set()

    def _hold(self, type_url: str, name: str, version: str | None) -> None:
        if version is None:
            self.held[type_url].pop(name, None)
        else:
            self.held[type_url][name] = version
        key = key_of(name)
        if type_url == CLUSTER_TYPE and key is not None:
            names = self.clusters_of.setdefault(key, set())
            if version is None:
                names.discard(name)
                if not names:
                    del self.clusters_of[key]
            else:
                names.add(name)

    def serves(self, key: MapKey) -> Route | None:
        """The route this Envoy serves for `key`, when it holds all of the map's resources."""
        name = map_name(key)
        version = self.held[ROUTE_TYPE].get(name)
        if version is None or name not in self.held[SCOPE_TYPE]:
            return None
        route = route_from_version(version)
        if route is None or len(self.clusters_of.get(key, ())) != len(route.backends):
            return None
        return route

    @property
    def readable(self) -> bool:
        """Envoy has listed what it holds: its cluster and scope requests came, and its route
        request too when it holds scopes."""
        types = {CLUSTER_TYPE, SCOPE_TYPE} | ({ROUTE_TYPE} if self.held[SCOPE_TYPE] else set())
        return types <= self.subscribed

    # --- what we send ---------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.step()

    async def step(self) -> None:
        """One pass toward the target; marks the generation synced when nothing is left dirty."""
        async with self.converging:
            generation = self.transport._generation
            if self.transport._seeded:
                await self._converge()
            else:
                await self._answer_first_requests()
            if not self.dirty or not self.transport._seeded:
                self.unacked_since = None if self.transport._seeded else self.unacked_since
                async with self.changed:
                    self.synced = generation
                    self.changed.notify_all()

    async def _answer_first_requests(self) -> None:
        """Before the first write the target is unknown: answer Envoy's first requests with empty
        responses (it starts serving sooner, and nothing it holds changes)."""
        for type_url in (CLUSTER_TYPE, SCOPE_TYPE):
            if type_url in self.owed_first:
                await self._push(type_url, [])

    async def _converge(self) -> None:
        """Bring this Envoy to the target for the dirty maps, in the order Envoy needs."""
        keys, self.dirty = self.dirty, set()
        if self.unacked_since is None:
            self.unacked_since = time.monotonic()
        # The parts as they are now: a write meanwhile marks its maps dirty for the next round.
        target = {k: part for k in keys if (part := self.transport._target.get(k)) is not None}
        keys -= {k for k in keys if k in self.nacks and self.nacks[k][0] == target.get(k)}
        await self._await_subscription(CLUSTER_TYPE)

        # 1. New and changed clusters, ACKed before any route names them; built batch by batch.
        def cluster_adds() -> Iterator[_Item]:
            for key in sorted(keys):
                part = target.get(key)
                if part is not None:
                    changed = tuple(r for r in part.clusters if self.held[CLUSTER_TYPE].get(r.name) != r.version)
                    if changed:
                        yield _Item(key, part, changed)

        keys -= await self._push(CLUSTER_TYPE, cluster_adds())
        await self._await_subscription(SCOPE_TYPE)
        # 2. Scopes of withdrawn maps leave first, so their host is free for another map's scope.
        gone = [_Item(k, None, removed=(map_name(k),)) for k in sorted(keys) if k not in target and map_name(k) in self.held[SCOPE_TYPE]]
        failed = await self._push(SCOPE_TYPE, gone)
        keys -= failed
        # 3. New and changed scopes, then the route configurations Envoy subscribes to for them.
        scopes = [
            _Item(k, target[k], (target[k].scope,))
            for k in sorted(keys)
            if k in target and self.held[SCOPE_TYPE].get(target[k].scope.name) != target[k].scope.version
        ]
        failed = await self._push(SCOPE_TYPE, scopes)
        keys -= failed
        # A route configuration Envoy holds no version of is not built to be compared, only to be sent.
        held_routes = self.held[ROUTE_TYPE]
        routes = [
            k for k in sorted(keys)
            if k in target and ((held := held_routes.get(map_name(k))) is None or held != target[k].route_config.version)
        ]
        if routes:
            await self._await_route_subscriptions(routes)
            items = (_Item(k, target[k], (target[k].route_config,)) for k in routes if map_name(k) in self.routes_wanted)
            keys -= await self._push(ROUTE_TYPE, items)
        # 4. Clusters no route names any more.
        stale = []
        for key in sorted(keys):
            part = target.get(key)
            keep = {r.name for r in part.clusters} if part is not None else set()
            removed = tuple(sorted(self.clusters_of.get(key, set()) - keep))
            if removed:
                stale.append(_Item(key, part, removed=removed))
        await self._push(CLUSTER_TYPE, stale)

    async def _await_subscription(self, type_url: str) -> None:
        """Envoy asks for clusters first, then for scopes once its clusters are in: wait for it."""
        deadline = time.monotonic() + self.transport.ack_timeout
        while type_url not in self.subscribed:
            if time.monotonic() > deadline:
                raise _Behind(f"no {_KIND[type_url]} subscription within {self.transport.ack_timeout:.1f}s")
            await self._wait_for_request()

    async def _await_route_subscriptions(self, keys: list[MapKey]) -> None:
        """A new scope makes Envoy subscribe to its route configuration, right after its ACK."""
        deadline = time.monotonic() + self.transport.ack_timeout
        while any(map_name(k) not in self.routes_wanted for k in keys) and time.monotonic() < deadline:
            await self._wait_for_request()

    async def _wait_for_request(self) -> None:
        """Until Envoy's next request (or 50 ms); leaves `wake` set, as a request may have more
        for the next round than the one awaited."""
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), 0.05)
        self.wake.set()

    async def _push(self, type_url: str, items: Iterable[_Item]) -> set[MapKey]:
        """Send `items` (batched; one map per response in steady state) and wait for each ACK. A
        NACKed batch is resent map by map; returns the maps Envoy refused. The next batch is
        taken from `items` while Envoy applies the one sent."""
        batches = _batches(items, self.transport.batch_maps)
        batch = next(batches, None)
        if batch is None:
            if type_url in self.owed_first:
                await self._send(type_url, [])
            return set()
        refused: set[MapKey] = set()
        while batch is not None:
            posted = await self._post(type_url, batch)
            await asyncio.sleep(0)  # the stream hands the response to gRPC before more is built
            upcoming = next(batches, None)
            error = await self._confirm(type_url, batch, posted)
            if error is not None and len(batch) == 1:
                self._refused(type_url, batch[0].key, batch[0].part, error)
                refused.add(batch[0].key)
            elif error is not None:
                for item in batch:
                    error = await self._send(type_url, [item])
                    if error is not None:
                        self._refused(type_url, item.key, item.part, error)
                        refused.add(item.key)
            batch = upcoming
        return refused

    def _refused(self, type_url: str, key: MapKey, part: MapResources | None, error: str) -> None:
        self.nack_counts[_KIND[type_url]] += 1
        self.nacks[key] = (part, f"envoy {self.name} refused the {_KIND[type_url]}: {error}")
        log.warning("envoy refused a map", extra={"envoy": self.name, "map": str(key), "kind": _KIND[type_url], "error": error})

    async def _send(self, type_url: str, items: list[_Item]) -> str | None:
        """One response; returns Envoy's error text on a NACK, None on an ACK. Raises _Behind."""
        return await self._confirm(type_url, items, await self._post(type_url, items))

    async def _post(self, type_url: str, items: list[_Item]) -> _Posted:
        """Queue one response for the stream; its ACK is awaited by `_confirm`."""
        nonce = f"{next(self.nonces)}"
        response = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=nonce, system_version_info=nonce)
        count = 0
        for item in items:
            for resource in item.resources:
                response.resources.add(name=resource.name, version=resource.version, resource=resource.packed(type_url))
                count += 1
            response.removed_resources.extend(item.removed)
            count += len(item.removed)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.pending = (nonce, future)
        self.owed_first.discard(type_url)
        self.sent += count
        posted = _Posted(future, count, self.transport.ack_timeout + self.transport.seconds_per_resource * count)
        try:
            if self.outbox.full():
                await asyncio.wait_for(self.outbox.put(response), posted.timeout)
            else:
                self.outbox.put_nowait(response)  # the usual case, without a task for the put
        except asyncio.TimeoutError as exc:
            self.pending = None
            raise _Behind(f"could not send {count} {_KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
        return posted

    async def _confirm(self, type_url: str, items: list[_Item], posted: _Posted) -> str | None:
        try:
            error = await asyncio.wait_for(posted.answer, posted.timeout)
        except asyncio.TimeoutError as exc:
            raise _Behind(f"no answer to {posted.count} {_KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
        finally:
            self.pending = None
        if error is None:
            for item in items:
                for resource in item.resources:
                    self._hold(type_url, resource.name, resource.version)
                for name in item.removed:
                    self._hold(type_url, name, None)
        return error

    def end(self) -> None:
        """End the stream: drop the queued response, if any, for the end mark."""
        with contextlib.suppress(asyncio.QueueEmpty):
            self.outbox.get_nowait()
        self.outbox.put_nowait(None)

    def status(self) -> EnvoyStatus:
        return EnvoyStatus(self.node, self.peer, self.connected_at, dict(self.nack_counts), self.unacked_since, self.sent)


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, transport: XdsTransport) -> None:
        self._transport = transport

    async def DeltaAggregatedResources(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        session = _Session(self._transport, context.peer())
        async with self._transport._attached(session, request_iterator):
            while (response := await session.outbox.get()) is not None:
                yield response
            if session.cut is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, session.cut)


class XdsTransport:
    """The Transport of Envoy's xDS mode (adapters.base.Transport[MapResources]).

    A write is confirmed when every connected Envoy ACKed it; a map any of them refuses is
    reported rejected with Envoy's words and put back as it was for all of them. An Envoy that
    does not answer a response within `ack_timeout` (plus `seconds_per_resource` each) has its
    stream ended: it stops counting, reconnects, lists what it holds and is brought up to date.
    """

    # Envoy answers a small response within milliseconds; a stuck one is cut after this.
    ack_timeout = 10.0
    # Envoy 1.40 spends up to 1.2 ms of its main thread per cluster on a 2-core machine: 3x that.
    seconds_per_resource = 0.004
    # Maps per response when many change at once (a first publish); a NACK then resends them one by one.
    batch_maps = 500
    shutdown_grace = 1.0

    # How long a read at start waits for a first Envoy to connect and list what it holds.
    read_wait = 3.0

    def __init__(self, listen: str, renderer: XdsRenderer) -> None:
        self._listen = listen
        self._renderer = renderer
        self._target: dict[MapKey, MapResources] = {}
        self._seeded = False
        self._generation = 0
        self._sessions: set[_Session] = set()
        self._server: grpc.aio.Server | None = None
        self._serving = asyncio.Event()
        self.port: int | None = None

    # --- the server -----------------------------------------------------------------------------------

    async def serve(self) -> None:
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(self), server)
        self.port = server.add_insecure_port(self._listen)
        if not self.port:
            raise OSError(f"cannot listen on {self._listen}")
        self._server = server
        await server.start()
        self._serving.set()
        log.info("xds server listening", extra={"listen": self._listen, "port": self.port})
        try:
            await server.wait_for_termination()
        finally:
            await asyncio.shield(self._stop())

    async def started(self) -> int:
        """Wait until `serve()` listens; the bound port (for a listen address with port 0)."""
        await self._serving.wait()
        assert self.port is not None
        return self.port

    async def _stop(self) -> None:
        # Streams end; each Envoy keeps serving what it holds and reconnects to the next sidecar.
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(self.shutdown_grace)

    @contextlib.asynccontextmanager
    async def _attached(
        self, session: _Session, requests: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]
    ) -> AsyncIterator[None]:
        async def read() -> None:
            try:
                async for request in requests:
                    session.receive(request)
                    if session not in self._sessions and session.node:
                        self._sessions.add(session)
                        log.info("envoy connected", extra={"envoy": session.name})
            finally:
                session.end()

        async def sync() -> None:
            try:
                await session.run()
            except Exception as exc:  # noqa: BLE001 - any failure ends this stream only; Envoy reconnects
                self._cut(session, exc)

        tasks = [asyncio.create_task(read()), asyncio.create_task(sync())]
        try:
            yield
        finally:
            # It stops counting at once, and the rest is shielded: gRPC may cancel the handler
            # again while it waits, which left a stopped server's Envoy counted as connected.
            self._sessions.discard(session)
            await asyncio.shield(self._detach(session, tasks))

    async def _detach(self, session: _Session, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sessions.discard(session)  # in case its reader added it back before it stopped
        async with session.changed:
            session.changed.notify_all()  # a write waiting on this Envoy stops waiting
        log.info("envoy disconnected", extra={"envoy": session.name})

    def _cut(self, session: _Session, exc: Exception) -> None:
        """End a stream that failed or fell behind: it stops counting, and its Envoy reconnects."""
        if session.cut is not None:
            return
        if not isinstance(exc, _Behind):
            log.error("xds stream failed", exc_info=exc, extra={"envoy": session.name})
        log.warning("ending an envoy's stream", extra={"envoy": session.name, "error": str(exc)})
        what = "fell behind" if isinstance(exc, _Behind) else "failed"
        session.cut = f"{what}: {exc}; reconnect to be brought up to date"
        self._sessions.discard(session)
        session.end()

    # --- Transport ------------------------------------------------------------------------------------

    def unready(self) -> str | None:
        return None if self._sessions else "no Envoy connected"

    def refusals(self) -> Mapping[MapKey, str]:
        return {}

    def hold_off(self) -> float:
        return 0.0

    async def read(self) -> dict[MapKey, Route]:
        """What every connected Envoy serves alike (a map they serve differently is left out);
        nothing when no Envoy connects within `read_wait`: each one that connects later lists what
        it holds and is brought to the target from there.

        The first read of a started transport also makes what it read the target, re-rendered, so
        an Envoy connecting before the first write gets it, and nothing it holds is taken away."""
        deadline = time.monotonic() + self.read_wait
        while not self._sessions or not all(s.readable for s in self._sessions):
            if time.monotonic() > deadline:
                if not self._sessions:
                    return {}
                raise Unavailable("envoy: a connected Envoy has not listed what it holds")
            await asyncio.sleep(0.01)
        served = self._served_by_all(list(self._sessions))
        if not self._seeded:
            self._target = {key: self._renderer.render(key, r) for key, r in served.items()}
            self._seeded = True
        return served

    def _served_by_all(self, sessions: list[_Session]) -> dict[MapKey, Route]:
        first, *others = sessions
        served: dict[MapKey, Route] = {}
        for name in first.held[SCOPE_TYPE]:
            key = key_of(name)
            if key is None:
                continue
            route = first.serves(key)
            if route is not None and all(s.serves(key) == route for s in others):
                served[key] = route
        return served

    async def write(self, parts: Mapping[MapKey, MapResources], changes: Mapping[MapKey, MapResources | None]) -> WriteResult:
        if not self._sessions:
            raise Unavailable("envoy: no Envoy connected")
        before = {key: self._target.get(key) for key in changes}
        if self._seeded:
            self._apply(changes)
            changed = set(changes)
        else:
            # The first write after a start that read nothing brings the whole state.
            self._target = dict(parts)
            self._seeded = True
            changed = set(self._target) | set(changes)
        sessions = await self._sync(changed)
        rejected: dict[MapKey, str] = {}
        for session in sessions:
            for key in changes:
                nack = session.nacks.get(key)
                if nack is not None and nack[0] == changes[key]:
                    rejected.setdefault(key, nack[1])
        if rejected:
            # Every Envoy goes back to what it served for a refused map, so the fleet agrees.
            self._apply({key: before[key] for key in rejected})
            await self._sync(set(rejected))
        return WriteResult(rejected=rejected)

    def _apply(self, changes: Mapping[MapKey, MapResources | None]) -> None:
        for key, part in changes.items():
            if part is None:
                self._target.pop(key, None)
            else:
                self._target[key] = part

    async def _sync(self, keys: set[MapKey]) -> list[_Session]:
        """Mark `keys` on every connected Envoy and wait until each converged or left."""
        self._generation += 1
        generation = self._generation
        sessions = list(self._sessions)
        idle = [s for s in sessions if not s.converging.locked()]
        for session in sessions:
            for key in keys:
                session.nacks.pop(key, None)
            session.dirty |= keys
            if session not in idle:
                session.wake.set()
        # An idle session is converged here; the others by their own task, once it is done.
        if len(idle) == 1:
            await self._step(idle[0])  # gather would start a task for it: the switch this avoids
        elif idle:
            await asyncio.gather(*(self._step(session) for session in idle))
        for session in sessions:
            async with session.changed:
                await session.changed.wait_for(lambda s=session: s.synced >= generation or s not in self._sessions)
        return sessions

    async def _step(self, session: _Session) -> None:
        try:
            await session.step()
        except Exception as exc:  # noqa: BLE001 - as in the session's own task: this stream only
            self._cut(session, exc)

    async def aclose(self) -> None:
        await self._stop()

    # --- per-Envoy state, for metrics and /debug/maps ---------------------------------------------------

    def envoys(self) -> list[EnvoyStatus]:
        # list() copies the set in one step: /metrics calls this from a worker thread.
        return sorted((s.status() for s in list(self._sessions)), key=lambda s: (s.node, s.peer))

    def served(self, key: MapKey) -> dict[str, str | None]:
        """Envoy name -> the version of `key`'s route configuration it holds (None: not served)."""
        return {s.name: s.held[ROUTE_TYPE].get(map_name(key), "").split(" ")[0] or None for s in list(self._sessions)}
