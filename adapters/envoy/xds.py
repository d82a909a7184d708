"""Envoy's xDS mode: the sidecar as a gRPC delta ADS server (grpc.aio, in the sidecar's event loop).

Owns the gRPC server, the connected Envoys, the target (what the engine wrote, and the maps it
withdrew), and what a write's confirmation means. Each Envoy's session is three parts: its state
and the plan from the target to the responses to send are pure (adapters.envoy.xds_plan, with
what a write's answers mean), and a small pump (adapters.envoy.xds_session) sends them one at a
time, a NACKed batch resent map by map to pin the refusal. It renders nothing (see
adapters.envoy.resources), decides nothing about maps and imports no metrics: per-Envoy state is
data (`envoys()`, read by publisher.metrics at scrape time; `served()`, for /debug/maps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Set

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from adapters.base import NotConnected, Unavailable, WriteResult
from adapters.envoy.lrs import LoadReports
from adapters.envoy.resources import SCOPE_TYPE, MapResources, XdsRenderer, key_of, map_name
from adapters.envoy.xds_plan import EnvoyState, WriteAnswer, add_votes, most_voted, served_versions, write_outcome
from adapters.envoy.xds_session import EnvoyStatus, Session
from adapters.grpc_server import SERVER_OPTIONS, Handlers, add_port, instance_label
from adapters.grpc_tls import ServerTls
from publisher.core.values import MapKey, Route

# The name it had before the move into adapters/envoy/: log filters keep working.
log = logging.getLogger("adapters.envoy_xds")

__all__ = ["XdsTransport"]

# A read gives the event loop back after each slice of this many maps of one Envoy.
READ_SLICE = 256


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, transport: XdsTransport) -> None:
        self._transport = transport

    async def DeltaAggregatedResources(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        self._transport.handlers.hold()
        session = Session(self._transport, context.peer())
        async with session.attached(request_iterator):
            while (response := await session.outbox.get()) is not None:
                yield response
            if session.cut is not None:
                await context.abort(*session.cut)


class _Server:
    """The gRPC server Envoys connect to: their ADS streams (`servicer`) and their load reports on
    one port, served until cancelled and stopped once: stopped when `handlers` (the streams') ended."""

    shutdown_grace = 1.0

    def __init__(
        self,
        listen: str,
        tls: ServerTls | None,
        servicer: ads_pb2_grpc.AggregatedDiscoveryServiceServicer,
        load_reports: LoadReports,
        handlers: Handlers,
    ) -> None:
        self._listen = listen
        # Mutual TLS for Envoys outside the pod (--envoy-xds-tls-*); None: plaintext.
        self._tls = tls
        self._servicer = servicer
        self._load_reports = load_reports
        self._handlers = handlers
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._serving = asyncio.Event()
        self.port: int | None = None

    async def serve(self) -> None:
        """Listen on the xDS address and serve Envoys until cancelled. An address another process
        holds raises OSError naming --envoy-xds-listen, as `--listen` is named for the HTTP server."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self._servicer, server)
        self._load_reports.add_to(server)
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
            await self.stop()

    async def started(self) -> int:
        """Wait until `serve()` listens; the bound port (for a listen address with port 0)."""
        await self._serving.wait()
        assert self.port is not None
        return self.port

    async def stop(self) -> None:
        """Streams end; each Envoy keeps serving what it holds and reconnects to the next sidecar.
        The stop is one task, held here and shielded: a cancelled serve() and a later aclose()
        both wait for it (a shielded stop nothing held was lost, and the server kept serving)."""
        if self._stopping is None:
            if self._server is None:
                return
            server, self._server = self._server, None
            self._stopping = asyncio.ensure_future(self._stop(server))
        await asyncio.shield(self._stopping)

    async def _stop(self, server: grpc.aio.Server) -> None:
        await server.stop(self.shutdown_grace)
        await self._handlers.ended(self.shutdown_grace)


class XdsTransport:
    """The Transport of Envoy's xDS mode (adapters.base.Transport[MapResources]).

    A write is confirmed when every Envoy connected through the whole write acknowledged it, and
    at least one did: with none connected it raises NotConnected, and when every one left before
    it answered, Unavailable. One truth per Envoy: a map some Envoys refuse while others take it
    (new weights on the same hostname) is held back on those Envoys alone: the others serve it, and
    the write reports it `held_back` naming the refusers and their words, so it is not published
    and is written again later. A map no Envoy took, and a hostname move or withdrawal any of them
    refuses (the engine's hostname promise needs every Envoy to let a hostname go), is reported
    rejected and put back as it was for all of them. An Envoy that refuses (one that NACKed since
    the write began) holds the write back only briefly: once every other Envoy converged, the write
    waits at most `refusal_wait` for it to finish taking the batch's maps one by one (which pins its
    refusal on the maps it refuses), and the maps it had not answered for then count as not
    acknowledged by it. A refusal outside a write (an Envoy that
    connected later) is kept for `refusals()`. An Envoy that does not answer a response within
    `ack_timeout` (plus `seconds_per_resource` each) has its stream ended: it stops counting,
    reconnects, lists what it holds and is brought up to date. A stream listing or subscribing
    more names of one type than `names_cap()` is ended with RESOURCE_EXHAUSTED. Nothing an Envoy
    holds is removed unless the engine asked.
    """

    # Envoy answers a small response within milliseconds; a stuck one is cut after this.
    ack_timeout = 10.0
    # How long a write waits, once every other Envoy converged, for a refusing Envoy to pin its
    # refusal: without it a busy machine reported the batch "not acknowledged" instead of naming
    # the refused map in the refusing Envoy's words.
    refusal_wait = 2.0
    # Envoy 1.40 spends up to 1.2 ms of its main thread per cluster on a 2-core machine: 3x that.
    seconds_per_resource = 0.004
    # Maps per response when many change at once (a first publish); a NACK then resends them one by one.
    batch_maps = 500

    # How long a read at start waits for a first Envoy to connect and list what it holds.
    read_wait = 3.0
    # Names one stream may list or subscribe per resource type: room for every map's clusters
    # (a map has a few), and for an Envoy listing what it holds before the sidecar knows the maps.
    names_floor = 100_000
    names_per_map = 10

    def __init__(self, listen: str, renderer: XdsRenderer, tls: ServerTls | None = None) -> None:
        self._renderer = renderer
        # Envoys report their requests per cluster on the same server, for the served-split check.
        # The tasks of every stream, ADS and LRS: the server's stop waits for them.
        self.handlers = Handlers()
        self.request_counter = LoadReports(self.handlers)
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
        self._sessions: set[Session] = set()
        self._server = _Server(listen, tls, _Servicer(self), self.request_counter, self.handlers)

    # --- the server -----------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The bound port once `serve()` listens (for a listen address with port 0); else None."""
        return self._server.port

    async def serve(self) -> None:
        """Listen on the xDS address and serve Envoys until cancelled (see _Server.serve)."""
        await self._server.serve()

    async def started(self) -> int:
        """Wait until `serve()` listens; the bound port (for a listen address with port 0)."""
        return await self._server.started()

    # --- what each Envoy's session reads, and tells (adapters.envoy.xds_session.Host) -------------------

    @property
    def target(self) -> Mapping[MapKey, MapResources]:
        return self._target

    @property
    def withdrawn(self) -> Set[MapKey]:
        return self._withdrawn

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def seeded(self) -> bool:
        return self._seeded

    def names_cap(self) -> int:
        """The names of one resource type one stream may list or subscribe."""
        return max(self.names_floor, self.names_per_map * len(self._target))

    def progressed(self) -> None:
        self._progress.set()

    def connected(self, session: Session) -> None:
        if session not in self._sessions:
            self._sessions.add(session)
            log.info("envoy connected", extra={"envoy": session.name})

    def disconnected(self, session: Session) -> None:
        self._sessions.discard(session)

    def refused(self, key: MapKey, part: MapResources | None, message: str) -> None:
        # A refusal of the write in progress is in the Envoy's state, where the write reads it.
        if not (self._writing is not None and key in self._writing and self._writing[key] == part):
            self._refusals[key] = (part, message)

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
        if not await self._readable():
            return {}
        served = await self._count_votes(lambda state: list(state.held[SCOPE_TYPE]))
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

    async def read_page(self, keys: Collection[MapKey]) -> dict[MapKey, Route]:
        """`read` for the maps of `keys` alone. Before the first read or write made a target,
        the page is read as `read` reads everything, which makes it."""
        if not self._seeded:
            served = await self.read()
            return {key: served[key] for key in keys if key in served}
        if not await self._readable():
            return {}
        names = [map_name(key) for key in keys]
        return await self._count_votes(lambda state: names)

    async def read_others(self, known: Collection[MapKey]) -> dict[MapKey, Route]:
        """`read` for the maps the Envoys hold besides `known`."""
        if not await self._readable():
            return {}

        def others(state: EnvoyState) -> list[str]:
            return [name for name in state.held[SCOPE_TYPE] if (key := key_of(name)) is not None and key not in known]

        return await self._count_votes(others)

    async def _readable(self) -> bool:
        """Whether an Envoy is connected, once every connected one has listed what it holds
        (waited for at most `read_wait`; False when none connected by then)."""
        deadline = time.monotonic() + self.read_wait
        while not self._sessions or not all(s.state.readable for s in self._sessions):
            if time.monotonic() > deadline:
                if not self._sessions:
                    return False
                raise Unavailable("envoy: a connected Envoy has not listed what it holds")
            await asyncio.sleep(0.01)
        return True

    async def _count_votes(self, names_of: Callable[[EnvoyState], list[str]]) -> dict[MapKey, Route]:
        """The route most Envoys serve for each scope `names_of` lists of them. Reading what an
        Envoy holds takes about 12 us a map: counted a slice at a time, 10,000 maps on two Envoys
        held the event loop 250 ms in one turn. The names are a snapshot, as the Envoys' streams
        go on meanwhile."""
        target = self._target if self._seeded else None
        votes: dict[MapKey, list[Route]] = {}
        for state in [s.state for s in sorted(self._sessions, key=lambda s: s.name)]:
            names = names_of(state)
            for start in range(0, len(names), READ_SLICE):
                add_votes(votes, state, names[start : start + READ_SLICE], target)
                await asyncio.sleep(0)
        return most_voted(votes)

    def refusals(self) -> Mapping[MapKey, str]:
        """Each map an Envoy refused outside a write since the last call (one that connected
        later, or a refusal met while putting a refused map back), in that Envoy's words, while
        the refused part is still what the engine asks for; the call drains them."""
        refusals, self._refusals = self._refusals, {}
        return {key: message for key, (part, message) in refusals.items() if self._target.get(key) == part}

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
            answers = [WriteAnswer(s.name, s.state, s.synced >= generation) for s in through]
            rejected, held_back = write_outcome(changes, before, self._target, answers)
            if rejected:
                # Every Envoy goes back to what it served for a map none took, or that leaves
                # its hostname, so the fleet agrees.
                self._apply({key: before[key] for key in rejected})
                await self._sync(set(rejected), nacked)
        finally:
            self._writing = None
        return WriteResult(rejected=rejected, held_back=held_back)

    def _apply(self, changes: Mapping[MapKey, MapResources | None]) -> None:
        for key, part in changes.items():
            if part is None:
                self._target.pop(key, None)
                self._withdrawn.add(key)
            else:
                self._target[key] = part
                self._withdrawn.discard(key)

    async def _sync(self, keys: set[MapKey], nacked: Mapping[Session, int]) -> tuple[int, list[Session]]:
        """Mark `keys` on every connected Envoy and wait until each converged or left, or refuses
        (NACKed more than `nacked` says, or in the round it is in) once every other Envoy converged
        and its round ended or `refusal_wait` passed: a refusing Envoy never holds the others'
        write back for long. Returns the generation and the Envoys connected from the start to the end."""
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

        refusing_since: float | None = None
        while True:
            through = [s for s in sessions if not s.closed and s in self._sessions]
            left = [s for s in through if s.synced < generation]
            if not left:
                return generation, through
            wait: float | None = None
            if len(left) < len(through) and all(s.nacked > nacked.get(s, 0) or s.nacked_this_round for s in left):
                if not any(s.converging.locked() for s in left):
                    return generation, through
                refusing_since = refusing_since if refusing_since is not None else time.monotonic()
                wait = refusing_since + self.refusal_wait - time.monotonic()
                if wait <= 0:
                    return generation, through
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):  # not wait_for: it may swallow a cancellation
                    await self._progress.wait()

    async def _step(self, session: Session) -> None:
        try:
            await session.step()
        except Exception as exc:  # noqa: BLE001 - as in the session's own task: this stream only
            session.cut_off(exc)

    async def aclose(self) -> None:
        await self._server.stop()

    # --- per-Envoy state, for metrics and /debug/maps ---------------------------------------------------

    def envoys(self) -> list[EnvoyStatus]:
        # list() copies the set in one step: /metrics calls this from a worker thread.
        return sorted((s.status() for s in list(self._sessions)), key=lambda s: (s.name, s.peer))

    def name_of(self, session: Session) -> str:
        """The Envoy's instance label (see EnvoyStatus.name), among the Envoys connected now."""
        others = [s.peer for s in list(self._sessions) if s is not session and s.node == session.node]
        return instance_label(session.node, session.peer, others)

    def served(self, key: MapKey) -> dict[str, str | None]:
        """Envoy name -> the version of `key`'s route configuration it holds (None: not served),
        followed by its words when it refused the map's current part."""
        return served_versions(key, self._target.get(key), [(s.name, s.state) for s in list(self._sessions)])
