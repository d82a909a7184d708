"""One Envoy's xDS stream: the pump that sends what the pure plan (adapters.envoy.xds_plan) says
for the Envoy's state, one response in flight, and feeds each answer back into that state; the
stream's reader, and its end when it fails, falls behind or lists too many names.

The transport (adapters.envoy.xds) owns the target, the connected Envoys and what a write's
confirmation means: a session reads the target from it (`Host`) and tells it when its Envoy
connected, synced, refused or left. `EnvoyStatus` is one session as operators see it
(publisher.metrics, at scrape time). It logs as the transport does, on "adapters.envoy_xds".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from adapters.envoy.resources import MapResources, map_name
from adapters.envoy.xds_plan import KIND, AwaitRequest, EnvoyState, Item, Send, plan, words
from publisher.core.values import MapKey

# The transport's logger (the name it had before the move into adapters/envoy/): filters keep working.
log = logging.getLogger("adapters.envoy_xds")

__all__ = ["Behind", "EnvoyStatus", "Gone", "Host", "Session", "TooMany"]


class Host(Protocol):
    """What a session reads of its transport (adapters.envoy.xds.XdsTransport), and tells it.

    target and withdrawn: what the engine wrote and the maps it withdrew; generation: the write a
    session that converges now has synced; seeded: the target is known (a write or a read made it).
    """

    ack_timeout: float
    seconds_per_resource: float
    batch_maps: int
    names_floor: int
    names_per_map: int

    @property
    def target(self) -> Mapping[MapKey, MapResources]: ...

    @property
    def withdrawn(self) -> Set[MapKey]: ...

    @property
    def generation(self) -> int: ...

    @property
    def seeded(self) -> bool: ...

    def names_cap(self) -> int:
        """The names of one resource type one stream may list or subscribe."""

    def name_of(self, session: Session) -> str:
        """The Envoy's instance label among the Envoys connected now (see EnvoyStatus.name)."""

    def connected(self, session: Session) -> None:
        """The session's Envoy said who it is: it counts as connected."""

    def disconnected(self, session: Session) -> None:
        """The session's stream ended or was cut: it stops counting."""

    def progressed(self) -> None:
        """A session synced, refused or ended: a write waiting on it looks again."""

    def refused(self, key: MapKey, part: MapResources | None, message: str) -> None:
        """The Envoy refused `part` of `key`, in `message`'s words."""


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


class Behind(Exception):
    """The Envoy did not answer a response in time: its stream is ended, and it reconnects."""


class Gone(Exception):
    """The Envoy's stream ended: nothing more is sent to it, and nothing waits for its answer."""


class TooMany(Exception):
    """The Envoy listed or subscribed more names than a stream may keep: its stream is ended."""


def _cut_status(exc: Exception, cap: str) -> tuple[grpc.StatusCode, str]:
    """The status a stream the sidecar ends for `exc` ends with (`cap`: the names cap, in words)."""
    if isinstance(exc, TooMany):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} (the cap is {cap})"
    what = "fell behind" if isinstance(exc, Behind) else "failed"
    return grpc.StatusCode.UNAVAILABLE, f"{what}: {exc}; reconnect to be brought up to date"


@dataclass(eq=False)
class Session:
    """The pump of one Envoy's stream: it sends what `plan` says for the Envoy's `state` (pure,
    adapters.envoy.xds_plan), one response in flight, and feeds each answer back into the state.
    `attached` runs it, and the reader of the stream's requests, while the gRPC handler lasts.

    The synchronisation it needs, each for one reason: `wake` (a request came or a write marked
    maps), `converging` (one task at a time brings this Envoy to the target: its own, or a write
    that found it the only Envoy, idle, and converges it itself, without the task switch a wake-up
    costs, about 1 ms at p50 and 10 ms at p99 on a busy loop), the transport's `progressed` (a
    write waits for `synced` to reach its generation, for the Envoy to refuse, or to leave),
    `outbox` (at most one response queued: everything else an Envoy is owed is the difference
    between the target and what it holds, recomputed, so a slow Envoy costs one response's worth
    of memory) and the `pending` answer."""

    transport: Host
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
        return self.transport.name_of(self)

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        if request.node.id:
            self.node = request.node.id
        if request.response_nonce and request.type_url in KIND:
            if self.pending is not None and self.pending[0] == request.response_nonce and not self.pending[1].done():
                self.pending[1].set_result(request.error_detail.message if request.HasField("error_detail") else None)
        self.state.receive(request, self.transport.target)
        self.wake.set()

    @contextlib.asynccontextmanager
    async def attached(self, requests: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]) -> AsyncIterator[None]:
        """While the stream lasts: its requests read into this session, and the pump run."""

        async def read() -> None:
            try:
                async for request in requests:
                    problem = self.state.over(request, self.transport.names_cap())
                    if problem is not None:
                        self.cut_off(TooMany(problem))
                        return
                    self.receive(request)
                    if self.node:
                        self.transport.connected(self)
            finally:
                self.end()

        async def sync() -> None:
            try:
                await self.run()
            except Exception as exc:  # noqa: BLE001 - any failure ends this stream only; Envoy reconnects
                self.cut_off(exc)

        tasks = [asyncio.create_task(read()), asyncio.create_task(sync())]
        try:
            yield
        finally:
            # It stops counting at once, and the rest is shielded: gRPC may cancel the handler
            # again while it waits, which left a stopped server's Envoy counted as connected.
            self.transport.disconnected(self)
            detach = asyncio.ensure_future(self._detach(tasks))
            self.transport.handlers.hold(detach)  # the server's stop waits for it too
            await asyncio.shield(detach)

    async def _detach(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.transport.disconnected(self)  # in case its reader added it back before it stopped
        self.transport.progressed()  # a write waiting on this Envoy stops waiting
        log.info("envoy disconnected", extra={"envoy": self.name})

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await self.step()

    async def step(self) -> None:
        """One round toward the target; marks the generation synced when nothing is left dirty."""
        async with self.converging:
            self.nacked_this_round = False
            generation = self.transport.generation
            seeded = self.transport.seeded
            await self._converge(seeded)
            if not self.state.dirty or not seeded:
                self.unacked_since = None if seeded else self.unacked_since
                self.synced = generation
                self.transport.progressed()

    async def _converge(self, seeded: bool) -> None:
        """Send what the plan says, step after step, until it has nothing more for this round."""
        keys: set[MapKey] = set()
        if seeded:
            keys, self.state.dirty = self.state.dirty, set()
            if self.unacked_since is None:
                self.unacked_since = time.monotonic()
        # The target as it is now: a write meanwhile marks its maps dirty for the next round.
        target = {k: part for k in keys if (part := self.transport.target.get(k)) is not None}
        withdrawn = {k for k in keys if k in self.transport.withdrawn}
        while (step := plan(self.state, target, withdrawn, keys, seeded=seeded)) is not None:
            if isinstance(step, Send):
                keys -= await self._push(step.type_url, step.items)
            elif not await self._await_request(step):
                if not step.keys:
                    raise Behind(f"no {KIND[step.type_url]} subscription within {self.transport.ack_timeout:.1f}s")
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
            raise Gone("the stream ended")
        self.wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05):  # not wait_for: it may swallow a cancellation
                await self.wake.wait()
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
        self.transport.progressed()

    def _refused(self, type_url: str, item: Item, error: str) -> None:
        self.nack_counts[KIND[type_url]] += 1
        message = f"envoy {self.name} refused the {KIND[type_url]}: {words(error)}"
        self.state.refused[item.key] = (item.part, message)
        self.transport.refused(item.key, item.part, message)
        self._nacked()
        log.warning("envoy refused a map", extra={"envoy": self.name, "map": str(item.key), "kind": KIND[type_url], "error": error})

    async def _post(self, type_url: str, items: list[Item]) -> _Posted:
        """Queue one response for the stream; its ACK is awaited by `_confirm`."""
        if self.closed:
            raise Gone("the stream ended")
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
                async with asyncio.timeout(posted.timeout):  # not wait_for: it may swallow a cancellation
                    await self.outbox.put(response)
            else:
                self.outbox.put_nowait(response)  # the usual case, without a task for the put
        except TimeoutError as exc:
            self.pending = None
            raise Behind(f"could not send {count} {KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
        return posted

    async def _confirm(self, type_url: str, items: list[Item], posted: _Posted) -> str | None:
        try:
            async with asyncio.timeout(posted.timeout):
                error = await posted.answer
        except TimeoutError as exc:
            raise Behind(f"no answer to {posted.count} {KIND[type_url]} resources in {posted.timeout:.1f}s") from exc
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
            self.pending[1].set_exception(Gone("the stream ended before its answer"))
        self.wake.set()
        self.transport.progressed()

    def cut_off(self, exc: Exception) -> None:
        """End a stream that failed, fell behind or listed too many names: it stops counting, and
        its Envoy reconnects. Nothing to do when it had ended already, or by itself."""
        if self.cut is not None or isinstance(exc, Gone):
            return  # cut already, or its stream ended by itself: nothing to cut
        if not isinstance(exc, (Behind, TooMany)):
            log.error("xds stream failed", exc_info=exc, extra={"envoy": self.name})
        log.warning("ending an envoy's stream", extra={"envoy": self.name, "error": str(exc)})
        self.cut = _cut_status(exc, f"max({self.transport.names_floor}, {self.transport.names_per_map} x maps)")
        self.transport.disconnected(self)
        self.end()

    def status(self) -> EnvoyStatus:
        refused = self.state.refusing(self.transport.target)
        return EnvoyStatus(self.name, self.node, self.peer, self.connected_at, dict(self.nack_counts), self.unacked_since, self.sent, refused)
