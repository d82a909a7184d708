"""Envoy's xDS mode: the sidecar as a gRPC delta ADS server (grpc.aio, in the sidecar's event loop).

Owns the streams of every connected Envoy, the target (what the engine wrote, and the maps it
withdrew), and what a write's confirmation means. Each Envoy's session is three parts: its state
and the plan from the target to the responses to send are pure (adapters.envoy.xds_plan), and a
small pump here sends them one at a time, a NACKed batch resent map by map to pin the refusal. It
renders nothing (see adapters.envoy.resources), decides nothing about maps and imports no
metrics: per-Envoy state is data (`envoys()`, read by publisher.metrics at scrape time;
`served()`, for /debug/maps).
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

from adapters.base import NotConnected, Unavailable, WriteResult
from adapters.envoy.lrs import LoadReports
from adapters.envoy.resources import ROUTE_TYPE, SCOPE_TYPE, MapResources, XdsRenderer, map_name
from adapters.envoy.xds_plan import KIND, AwaitRequest, EnvoyState, Item, Send, add_votes, fleet_message, most_voted, plan, words
from adapters.grpc_server import SERVER_OPTIONS, add_port, instance_label
from adapters.grpc_tls import ServerTls
from publisher.core.values import MapKey, Route

# The name it had before the move into adapters/envoy/: log filters keep working.
log = logging.getLogger("adapters.envoy_xds")

__all__ = ["EnvoyStatus", "XdsTransport"]

# A read gives the event loop back after each slice of this many maps of one Envoy.
READ_SLICE = 256


@dataclass(frozen=True)
class EnvoyStatus:
    """One connected Envoy as operators see it.

    name: the instance label: the node id, qualified by the peer's host only when two connected
    Envoys share a node id (and by its port only when they share the host too), so a reconnect from
    a new ephemeral port makes no new series. node: Envoy's node id; peer: its address. nacks:
    refusals since it connected, by resource kind (cluster, scope, route). unacked_since: monotonic
    time of the oldest change it has not ACKed, or None when it serves everything it was given.
    sent: resources added or removed on this stream. refused: maps whose current weights it
    refused, so it serves their older ones (held back on it alone).
    """

    name: str
    node: str
    peer: str
    connected_at: float
    nacks: Mapping[str, int]
    unacked_since: float | None
    sent: int
    refused: int = 0


@dataclass(frozen=True)
class _Posted:
    """A response queued for the stream: Envoy's answer (its error text, or None for an ACK),
    how many resources it carried, and how long its ACK may take."""

    answer: asyncio.Future[str | None]
    count: int
    timeout: float


def _batches(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class _Behind(Exception):
    """The Envoy did not answer a response in time: its stream is ended, and it reconnects."""


class _Gone(Exception):
    """The Envoy's stream ended: nothing more is sent to it, and nothing waits for its answer."""


class _TooMany(Exception):
    """The Envoy listed or subscribed more names than a stream may keep: its stream is ended."""


@dataclass(eq=False)
class _Session:
    """The pump of one Envoy's stream: it sends what `plan` says for the Envoy's `state` (pure,
    adapters.envoy.xds_plan), one response in flight, and feeds each answer back into the state.

    The synchronisation it needs, each for one reason: `wake` (a request came or a write marked
    maps), `converging` (one task at a time brings this Envoy to the target: its own, or a write
    that found it the only Envoy, idle, and converges it itself, without the task switch a wake-up
    costs, about 1 ms at p50 and 10 ms at p99 on a busy loop), the transport's `_progress` (a
    write waits for `synced` to reach its generation, for the Envoy to refuse, or to leave),
    `outbox` (at most one response queued: everything else an Envoy is owed is the difference
    between the target and what it holds, recomputed, so a slow Envoy costs one response's worth
    of memory) and the `pending` answer."""

    transport: XdsTransport
    peer: str
    node: str = ""
    connected_at: float = field(default_factory=time.monotonic)
    state: EnvoyState = field(default_factory=EnvoyState)
    nack_counts: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    synced: int = -1
    nacked: int = 0  # responses it refused on this stream, counted once the refusal is recorded
    nacked_this_round: bool = False  # its round toward the target so far met a NACK
    unacked_since: float | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    converging: asyncio.Lock = field(default_factory=asyncio.Lock)
    outbox: asyncio.Queue[discovery_pb2.DeltaDiscoveryResponse | None] = field(default_factory=lambda: asyncio.Queue(maxsize=1))
    pending: tuple[str, asyncio.Future[str | None]] | None = None
    nonces: itertools.count[int] = field(default_factory=itertools.count)
    cut: tuple[grpc.StatusCode, str] | None = None  # why the sidecar ended this stream
    closed: bool = False  # the stream ended: whatever waits on this Envoy stops waiting

    @property
    def name(self) -> str:
        return self.transport._name_of(self)

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        if request.node.id:
            self.node = request.node.id
        if request.response_nonce and request.type_url in KIND:
            if self.pending is not None and self.pending[0] == request.response_nonce and not self.pending[1].done():
                self.pending[1].set_result(request.error_detail.message if request.HasField("error_detail") else None)
        self.state.receive(request, self.transport._target)
        self.wake.set()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.step()

    async def step(self) -> None:
        """One round toward the target; marks the generation synced when nothing is left dirty."""
        async with self.converging:
            self.nacked_this_round = False
            generation = self.transport._generation
            seeded = self.transport._seeded
            await self._converge(seeded)
            if not self.state.dirty or not seeded:
                self.unacked_since = None if seeded else self.unacked_since
                self.synced = generation
                self.transport._progressed()

    async def _converge(self, seeded: bool) -> None:
        """Send what the plan says, step after step, until it has nothing more for this round."""
        keys: set[MapKey] = set()
        if seeded:
            keys, self.state.dirty = self.state.dirty, set()
            if self.unacked_since is None:
                self.unacked_since = time.monotonic()
        # The target as it is now: a write meanwhile marks its maps dirty for the next round.
        target = {k: part for k in keys if (part := self.transport._target.get(k)) is not None}
        withdrawn = {k for k in keys if k in self.transport._withdrawn}
        while (step := plan(self.state, target, withdrawn, keys, seeded=seeded)) is not None:
            if isinstance(step, Send):
                keys -= await self._push(step.type_url, step.items)
            elif not await self._await_request(step):
                if not step.keys:
                    raise _Behind(f"no {KIND[step.type_url]} subscription within {self.transport.ack_timeout:.1f}s")
                keys -= step.keys  # sent once Envoy subscribes them: its request marks them dirty

    async def _await_request(self, step: AwaitRequest) -> bool:
        """Until Envoy subscribed what `step` waits for (True), or `ack_timeout` passed (False).
        Only the awaited names are checked per request, not the whole plan again: a first publish
        brings one route subscription per batch of scopes."""
        deadline = time.monotonic() + self.transport.ack_timeout
        wanted = self.state.routes_wanted
        names = [map_name(k) for k in step.keys]
        while not (all(name in wanted for name in names) if names else step.type_url in self.state.subscribed):
            if time.monotonic() > deadline:
                return False
            await self._wait_for_request()
        return True

    async def _wait_for_request(self) -> None:
        """Until Envoy's next request (or 50 ms); leaves `wake` set, as a request may have more
        for the next round than the one awaited."""
        if self.closed:
            raise _Gone("the stream ended")
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), 0.05)
        self.wake.set()

    async def _push(self, type_url: str, items: Iterable[Item]) -> set[MapKey]:
        """Send `items` (batched; one map per response in steady state; one empty response when
        there are none) and wait for each answer. A NACKed batch is resent map by map; returns the
        maps Envoy refused. The next batch is taken from `items` while Envoy applies the one sent."""
        batches = _batches(items, self.transport.batch_maps)
        batch: list[Item] | None = next(batches, [])
        refused: set[MapKey] = set()
        while batch is not None:
            posted = await self._post(type_url, batch)
            await asyncio.sleep(0)  # the stream hands the response to gRPC before more is built
            upcoming = next(batches, None)
            error = await self._confirm(type_url, batch, posted)
            if error is not None and len(batch) == 1:
                self._refused(type_url, batch[0], error)
                refused.add(batch[0].key)
            elif error is not None:
                self._nacked()
                for item in batch:
                    error = await self._confirm(type_url, [item], await self._post(type_url, [item]))
                    if error is not None:
                        self._refused(type_url, item, error)
                        refused.add(item.key)
            batch = upcoming
        return refused

    def _nacked(self) -> None:
        """It refused a response (its refusal, if pinned on a map, is recorded): a write waiting
        on it may stop waiting."""
        self.nacked += 1
        self.nacked_this_round = True
        self.transport._progressed()

    def _refused(self, type_url: str, item: Item, error: str) -> None:
        self.nack_counts[KIND[type_url]] += 1
        message = f"envoy {self.name} refused the {KIND[type_url]}: {words(error)}"
        self.state.refused[item.key] = (item.part, message)
        self.transport._refusal(item.key, item.part, message)
        self._nacked()
        log.warning("envoy refused a map", extra={"envoy": self.name, "map": str(item.key), "kind": KIND[type_url], "error": error})

    async def _post(self, type_url: str, items: list[Item]) -> _Posted:
        """Queue one response for the stream; its ACK is awaited by `_confirm`."""
        if self.closed:
            raise _Gone("the stream ended")
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
        self.state.owed_first.discard(type_url)
        self.sent += count
        posted = _Posted(future, count, self.transport.ack_timeout + self.transport.seconds_per_resource * count)
        try:
            if self.outbox.full():
                await asyncio.wait_for(self.outbox.put(response), posted.timeout)
            else:
                self.outbox.put_nowait(response)  # the usual case, without a task for the put
        except asyncio.TimeoutError as exc:
            self.pending = None
            raise _Behind(f"could not send {count} {KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
        return posted

    async def _confirm(self, type_url: str, items: list[Item], posted: _Posted) -> str | None:
        try:
            error = await asyncio.wait_for(posted.answer, posted.timeout)
        except asyncio.TimeoutError as exc:
            raise _Behind(f"no answer to {posted.count} {KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
        finally:
            self.pending = None
        if error is None:
            self.state.acknowledged(type_url, items)
        return error

    def end(self) -> None:
        """End the stream: drop the queued response, if any, for the end mark, and release
        whoever waits for this Envoy's answer (a write returns at once, not after its timeout)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(asyncio.QueueEmpty):
            self.outbox.get_nowait()
        self.outbox.put_nowait(None)
        if self.pending is not None and not self.pending[1].done():
            self.pending[1].set_exception(_Gone("the stream ended before its answer"))
        self.wake.set()
        self.transport._progressed()

    def status(self) -> EnvoyStatus:
        refused = self.state.refusing(self.transport._target)
        return EnvoyStatus(self.name, self.node, self.peer, self.connected_at, dict(self.nack_counts), self.unacked_since, self.sent, refused)


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
                await context.abort(*session.cut)


class XdsTransport:
    """The Transport of Envoy's xDS mode (adapters.base.Transport[MapResources]).

    A write is confirmed when every Envoy connected through the whole write acknowledged it, and
    at least one did: with none connected it raises NotConnected, and when every one left before
    it answered, Unavailable. One truth per Envoy: a map some Envoys refuse while others take it
    (new weights on the same hostname) is held back on those Envoys alone: the others serve it, and
    the write reports it `held_back` naming the refusers and their words, so it is not published
    and is written again later. A map no Envoy took, and a hostname move or withdrawal any of them
    refuses (the engine's hostname promise needs every Envoy to let a hostname go), is reported
    rejected and put back as it was for all of them. The write waits for an Envoy that refuses (one
    that NACKed since the write began) only while others are still converging: the maps it had not
    answered for then count as not acknowledged by it. A refusal outside a write (an Envoy that
    connected later) is kept for `refusals()`. An Envoy that does not answer a response within
    `ack_timeout` (plus `seconds_per_resource` each) has its stream ended: it stops counting,
    reconnects, lists what it holds and is brought up to date. A stream listing or subscribing
    more names of one type than `names_cap()` is ended with RESOURCE_EXHAUSTED. Nothing an Envoy
    holds is removed unless the engine asked.
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
    # Names one stream may list or subscribe per resource type: room for every map's clusters
    # (a map has a few), and for an Envoy listing what it holds before the sidecar knows the maps.
    names_floor = 100_000
    names_per_map = 10

    def __init__(self, listen: str, renderer: XdsRenderer, tls: ServerTls | None = None) -> None:
        self._listen = listen
        # Mutual TLS for Envoys outside the pod (--envoy-xds-tls-*); None: plaintext.
        self._tls = tls
        self._renderer = renderer
        # Envoys report their requests per cluster on the same server, for the served-split check.
        self.request_counter = LoadReports()
        self._target: dict[MapKey, MapResources] = {}
        # Maps the engine asked to remove: the only ones taken from an Envoy that still lists them.
        self._withdrawn: set[MapKey] = set()
        self._seeded = False
        # The changes of the write in progress, whose refusals its result reports from each
        # Envoy's state; any other refusal waits in `_refusals` for the engine to ask.
        self._writing: Mapping[MapKey, MapResources | None] | None = None
        self._refusals: dict[MapKey, tuple[MapResources | None, str]] = {}
        self._generation = 0
        # Set when a session synced, refused or ended: what a write waits on.
        self._progress = asyncio.Event()
        self._sessions: set[_Session] = set()
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._serving = asyncio.Event()
        self.port: int | None = None

    # --- the server -----------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Listen on the xDS address and serve Envoys until cancelled. An address another process
        holds raises OSError naming --envoy-xds-listen, as `--listen` is named for the HTTP server."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(self), server)
        self.request_counter.add_to(server)
        self.port = add_port(server, self._listen, "--envoy-xds-listen", self._tls)
        self._server = server
        await server.start()
        self._serving.set()
        log.info("xds server listening", extra={"listen": self._listen, "port": self.port})
        try:
            # Until cancelled: gRPC's wait_for_termination, cancelled, cancels the server's graceful
            # stop too, and the old server kept its streams and its port.
            await asyncio.Event().wait()
        finally:
            await self._stop()

    async def started(self) -> int:
        """Wait until `serve()` listens; the bound port (for a listen address with port 0)."""
        await self._serving.wait()
        assert self.port is not None
        return self.port

    async def _stop(self) -> None:
        """Streams end; each Envoy keeps serving what it holds and reconnects to the next sidecar.
        The stop is one task, held here and shielded: a cancelled serve() and a later aclose()
        both wait for it (a shielded stop nothing held was lost, and the server kept serving)."""
        if self._stopping is None:
            if self._server is None:
                return
            server, self._server = self._server, None
            self._stopping = asyncio.ensure_future(server.stop(self.shutdown_grace))
        await asyncio.shield(self._stopping)

    @contextlib.asynccontextmanager
    async def _attached(
        self, session: _Session, requests: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]
    ) -> AsyncIterator[None]:
        async def read() -> None:
            try:
                async for request in requests:
                    problem = session.state.over(request, self.names_cap())
                    if problem is not None:
                        self._cut(session, _TooMany(problem))
                        return
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
        self._progressed()  # a write waiting on this Envoy stops waiting
        log.info("envoy disconnected", extra={"envoy": session.name})

    def _cut(self, session: _Session, exc: Exception) -> None:
        """End a stream that failed or fell behind: it stops counting, and its Envoy reconnects."""
        if session.cut is not None:
            return
        if isinstance(exc, _Gone):
            return  # its stream ended by itself: nothing to cut
        if not isinstance(exc, (_Behind, _TooMany)):
            log.error("xds stream failed", exc_info=exc, extra={"envoy": session.name})
        log.warning("ending an envoy's stream", extra={"envoy": session.name, "error": str(exc)})
        if isinstance(exc, _TooMany):
            session.cut = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (the cap is max({self.names_floor}, {self.names_per_map} x maps))")
        else:
            what = "fell behind" if isinstance(exc, _Behind) else "failed"
            session.cut = (grpc.StatusCode.UNAVAILABLE, f"{what}: {exc}; reconnect to be brought up to date")
        self._sessions.discard(session)
        session.end()

    def names_cap(self) -> int:
        """The names of one resource type one stream may list or subscribe."""
        return max(self.names_floor, self.names_per_map * len(self._target))

    def _progressed(self) -> None:
        self._progress.set()

    # --- Transport ------------------------------------------------------------------------------------

    def unready(self) -> str | None:
        return None if self._sessions else "no Envoy connected"

    def hold_off(self) -> float:
        return 0.0

    async def read(self) -> dict[MapKey, Route]:
        """What the connected Envoys serve: every map one of them serves, with the route most of
        them hold (a tie goes to the Envoy first by name); nothing when no Envoy connects within
        `read_wait`: each one that connects later lists what it holds, and keeps it until the
        engine writes or withdraws it.

        The first read of a started transport also makes what it read the target, re-rendered, so
        an Envoy connecting before the first write gets it, Envoys that disagree on a map converge
        on the route the read reported, and nothing they hold is taken away."""
        deadline = time.monotonic() + self.read_wait
        while not self._sessions or not all(s.state.readable for s in self._sessions):
            if time.monotonic() > deadline:
                if not self._sessions:
                    return {}
                raise Unavailable("envoy: a connected Envoy has not listed what it holds")
            await asyncio.sleep(0.01)
        # Reading what an Envoy holds takes about 12 us a map: counted a slice at a time, 10,000
        # maps on two Envoys held the event loop 250 ms in one turn. A snapshot of the names, as
        # the Envoys' streams go on meanwhile.
        target = self._target if self._seeded else None
        votes: dict[MapKey, Counter[Route]] = {}
        for state in [s.state for s in sorted(self._sessions, key=lambda s: s.name)]:
            names = list(state.held[SCOPE_TYPE])
            for start in range(0, len(names), READ_SLICE):
                add_votes(votes, state, names[start : start + READ_SLICE], target)
                await asyncio.sleep(0)
        served = most_voted(votes)
        if not self._seeded:
            seeded: dict[MapKey, MapResources] = {}
            for count, (key, route) in enumerate(served.items(), 1):
                seeded[key] = self._renderer.render(key, route)
                if count % READ_SLICE == 0:
                    await asyncio.sleep(0)
            self._target = seeded
            self._seeded = True
            for session in self._sessions:
                session.state.dirty.update(self._target)
                session.wake.set()
        return served

    def refusals(self) -> Mapping[MapKey, str]:
        """Each map an Envoy refused outside a write since the last call (one that connected
        later, or a refusal met while putting a refused map back), in that Envoy's words, while
        the refused part is still what the engine asks for; the call drains them."""
        refusals, self._refusals = self._refusals, {}
        return {key: message for key, (part, message) in refusals.items() if self._target.get(key) == part}

    def _refusal(self, key: MapKey, part: MapResources | None, message: str) -> None:
        # A refusal of the write in progress is in the Envoy's state, where the write reads it.
        if not (self._writing is not None and key in self._writing and self._writing[key] == part):
            self._refusals[key] = (part, message)

    async def write(self, parts: Mapping[MapKey, MapResources], changes: Mapping[MapKey, MapResources | None]) -> WriteResult:
        if not self._sessions:
            raise NotConnected("envoy: no Envoy connected")
        before = {key: self._target.get(key) for key in changes}
        if self._seeded:
            self._apply(changes)
            changed = set(changes)
        else:
            # The first write after a start that read nothing brings the whole state.
            self._target = dict(parts)
            self._withdrawn.update(key for key, part in changes.items() if part is None)
            self._seeded = True
            changed = set(self._target) | set(changes)
        nacked = {s: s.nacked for s in self._sessions}
        self._writing = changes
        try:
            generation, through = await self._sync(changed, nacked)
            if not through:
                raise Unavailable("envoy: every Envoy connected at the write's start left before it acknowledged the write")
            rejected, held_back = self._outcome(changes, before, generation, through)
            if rejected:
                # Every Envoy goes back to what it served for a map none took, or that leaves
                # its hostname, so the fleet agrees.
                self._apply({key: before[key] for key in rejected})
                await self._sync(set(rejected), nacked)
        finally:
            self._writing = None
        return WriteResult(rejected=rejected, held_back=held_back)

    def _outcome(
        self, changes: Mapping[MapKey, MapResources | None], before: Mapping[MapKey, MapResources | None], generation: int, through: list[_Session]
    ) -> tuple[dict[MapKey, str], dict[MapKey, str]]:
        """Each changed map not every Envoy took: rejected (put back for all) when none took it, or
        when it moves or leaves its hostname; held back on the refusers otherwise."""
        rejected: dict[MapKey, str] = {}
        held_back: dict[MapKey, str] = {}
        for key in changes:
            part = self._target.get(key)
            refusals: list[str] = []
            pending: list[str] = []
            took = 0
            for session in through:
                refusal = session.state.refusal(key, part)
                if refusal is not None:
                    refusals.append(refusal)
                elif session.synced >= generation or session.state.holds(key, part):
                    took += 1
                else:
                    pending.append(session.name)
            if not refusals and not pending:
                continue
            old = before[key]
            if took and part is not None and (old is None or old.route.hostname == part.route.hostname):
                held_back[key] = fleet_message(refusals, pending, took)
            else:
                rejected[key] = fleet_message(refusals, pending, 0)
        return rejected, held_back

    def _apply(self, changes: Mapping[MapKey, MapResources | None]) -> None:
        for key, part in changes.items():
            if part is None:
                self._target.pop(key, None)
                self._withdrawn.add(key)
            else:
                self._target[key] = part
                self._withdrawn.discard(key)

    async def _sync(self, keys: set[MapKey], nacked: Mapping[_Session, int]) -> tuple[int, list[_Session]]:
        """Mark `keys` on every connected Envoy and wait until each converged or left, or refuses
        (NACKed more than `nacked` says, or in the round it is in) once every other Envoy converged:
        a refusing Envoy never holds the others' write back. Returns the generation and the Envoys
        connected from the start to the end."""
        self._generation += 1
        generation = self._generation
        sessions = list(self._sessions)
        for session in sessions:
            for key in keys:
                session.state.refused.pop(key, None)
            session.state.dirty |= keys
        if len(sessions) == 1 and not sessions[0].converging.locked():
            await self._step(sessions[0])  # the only Envoy, converged here: no task switch
        else:
            for session in sessions:
                session.wake.set()

        while True:
            through = [s for s in sessions if not s.closed and s in self._sessions]
            left = [s for s in through if s.synced < generation]
            if not left or (len(left) < len(through) and all(s.nacked > nacked.get(s, 0) or s.nacked_this_round for s in left)):
                return generation, through
            self._progress.clear()
            await self._progress.wait()

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
        return sorted((s.status() for s in list(self._sessions)), key=lambda s: (s.name, s.peer))

    def _name_of(self, session: _Session) -> str:
        """The Envoy's instance label (see EnvoyStatus.name), among the Envoys connected now."""
        others = [s.peer for s in list(self._sessions) if s is not session and s.node == session.node]
        return instance_label(session.node, session.peer, others)

    def served(self, key: MapKey) -> dict[str, str | None]:
        """Envoy name -> the version of `key`'s route configuration it holds (None: not served),
        followed by its words when it refused the map's current part."""
        part = self._target.get(key)
        served: dict[str, str | None] = {}
        for session in list(self._sessions):
            version = session.state.held[ROUTE_TYPE].get(map_name(key), "").split(" ")[0] or None
            refusal = session.state.refusal(key, part)
            served[session.name] = version if refusal is None else f"{version or 'nothing'}, holding back the current weights: {refusal}"
        return served
