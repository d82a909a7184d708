"""`Informer`: list then watch one resource in one namespace (or all), feeding one Store, with
client-go's semantics (paginated list, watch with bookmarks, relist on 410, backoff that resets
after a healthy watch); `WatchOptions`, the knobs of every informer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp

from publisher import metrics
from publisher.core.model import object_key
from publisher.kube import Kube, KubeError, Resource
from publisher.retry import ReconnectBackoff
from publisher.source.informer_state import Changed, Digests, InformerHealth, Listing, Reconnects
from publisher.source.objects import MapDigest, resource_version
from publisher.source.refusals import REFUSAL_CODES, SourceRefused, describe_refusal, scope_in_words
from publisher.source.store import ChangeSink, Store
from publisher.source.watch import Bookmark, Event, Relist, WatchError, WatchState

log = logging.getLogger("publisher.source")  # the logger name these logs have always printed
T = TypeVar("T")


class _Gone(Exception):
    pass


# Transient failures of list and watch: retried with capped backoff, logged on the first of a streak.
_TRANSIENT = (KubeError, aiohttp.ClientError, asyncio.TimeoutError, WatchError, ConnectionError)


@dataclass(frozen=True)
class WatchOptions:
    namespaces: tuple[str, ...] = ()
    label_selector: str | None = None
    # Pages of 500 keep one list response near a megabyte for 4-entry maps.
    page_size: int = 500
    # The server ends a watch after this; we reopen from the last version (cheap, no relist).
    watch_seconds: int = 300
    # Bookmarks arrive about once a minute from a real server; twice that silent means dead.
    silence_timeout: float = 120.0
    # Reconnect backoff: starts small so a dropped connection costs little, caps low enough that
    # the first change after an outage is seen within seconds of recovery.
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    # A watch connected this long counts as healthy: its next drop starts the backoff over.
    backoff_reset: float = 60.0
    # A refusal (400, 401, 403, 404) is not fixed by hammering: retried at this slow pace.
    refusal_retry: float = 30.0
    # --once and --dry-run: a refusal ends the source at once instead of being retried.
    refusals_fatal: bool = False
    # Warn once when no list or watch has succeeded for this long (the gateway keeps serving).
    stale_after: float = 300.0
    # This sidecar's instance name: a TrafficMap event that changes only other instances'
    # conditions is not parsed or decided (with R regions, R - 1 of every R status events), and
    # one that changes only its own (the echo of its status write) is parsed but not decided.
    # None: every event is both.
    region: str | None = None


class Informer(Generic[T]):
    """List then watch one resource in one namespace (or all), feeding one Store.

    `parse` turns a raw object into what the Store keeps (None: unusable, treated as absent).
    List pages are parsed as they arrive, so the raw objects of only one page are alive at once.
    Nothing the API server does empties the Store: only a list that succeeds replaces it.
    `digest`, when given, says what of an object matters: an event with the digest the Store's
    object was parsed from only moves its resourceVersion; one that changed only this instance's
    own condition is stored, and the sink told it was `reported`, not `changed`; `restatus`, when
    given, makes what is stored then from the Store's object and the event (only the status new).
    """

    def __init__(
        self,
        kube: Kube,
        resource: Resource,
        *,
        namespace: str | None,
        options: WatchOptions,
        store: Store[T],
        parse: Callable[[dict[str, Any]], T | None],
        sink: ChangeSink,
        on_synced: Callable[[], None],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        digest: Callable[[dict[str, Any]], MapDigest | None] | None = None,
        restatus: Callable[[T, dict[str, Any]], T | None] | None = None,
    ) -> None:
        self._kube = kube
        self._resource = resource
        self._namespace = namespace
        self._options = options
        self._store = store
        self._parse = parse
        self._sink = sink
        self._on_synced = on_synced
        self._clock = clock
        self._sleep = sleep
        self._digest = digest
        self._restatus = restatus
        self._digests = Digests()
        self._reconnects = Reconnects(ReconnectBackoff(options.backoff_initial, options.backoff_max, options.backoff_reset))
        # For staleness and the operator (KubeSource reads it).
        self.health = InformerHealth()
        # Looked up once: every watch chunk marks a success.
        self._success_gauge = metrics.SOURCE_LAST_SUCCESS.labels(resource=resource.plural, namespace=namespace or "")

    async def run(self) -> None:
        synced = False
        state: WatchState | None = None
        while True:
            verb = "list" if state is None else "watch"
            try:
                if state is None:
                    state = WatchState(await self._list())
                    if not synced:
                        synced = True
                        self._on_synced()
                await self._watch_once(state)
                self._reconnects.ended(self._clock())
            except _Gone as gone:
                self._reconnects.ended(self._clock())
                state = None
                metrics.WATCH_RESTARTS.labels(resource=self._resource.plural, reason="Expired").inc()
                log.info("watch expired, relisting", extra={"resource": self._resource.plural, "namespace": scope_in_words(self._namespace), "reason": str(gone)})
                # A storm of 410s relists at the backoff's pace, not in a tight loop.
                await self._sleep(self._reconnects.failed())
            except _TRANSIENT as exc:
                self._reconnects.ended(self._clock())
                if isinstance(exc, KubeError) and exc.code in REFUSAL_CODES:
                    await self._sleep(self._on_refused(exc, verb))
                else:
                    await self._sleep(self._on_transient(exc, verb))

    def _succeeded(self) -> None:
        recovery = self.health.succeeded(self._clock())
        self._success_gauge.set(time.time())
        if recovery is None:
            return
        if recovery.after is not None:
            log.info(
                "source recovered",
                extra={"resource": self._resource.plural, "namespace": scope_in_words(self._namespace), "after": recovery.after},
            )
        if recovery.refusal_ended:
            metrics.SOURCE_REFUSED.labels(resource=self._resource.plural, namespace=self._namespace or "").set(0)

    def _on_transient(self, exc: BaseException, verb: str) -> float:
        reason = exc.reason if isinstance(exc, KubeError) and exc.reason else type(exc).__name__
        metrics.WATCH_RESTARTS.labels(resource=self._resource.plural, reason=reason).inc()
        problem = f"{verb} {self._resource.plural}.{self._resource.group} in {scope_in_words(self._namespace)}: {exc}"
        if self.health.failed(problem):
            log.warning("watch restarting", extra={"resource": self._resource.plural, "namespace": scope_in_words(self._namespace), "verb": verb, "error": str(exc)})
        return self._reconnects.failed()

    def _on_refused(self, exc: KubeError, verb: str) -> float:
        message = describe_refusal(exc, verb, self._resource, self._namespace)
        if self._options.refusals_fatal:
            raise SourceRefused(message) from exc
        metrics.SOURCE_REFUSED.labels(resource=self._resource.plural, namespace=self._namespace or "").set(1)
        if self.health.refused(message):
            log.error("source refused", extra={"resource": self._resource.plural, "namespace": scope_in_words(self._namespace), "verb": verb, "error": message})
        return self._options.refusal_retry

    async def _list(self) -> str:
        listing: Listing[T] = Listing(self._resource.plural)
        while True:
            page = await self._kube.list(
                self._resource,
                namespace=self._namespace,
                label_selector=self._options.label_selector,
                limit=self._options.page_size,
                continue_token=listing.token,
            )
            for raw in listing.items(page):
                key = object_key(raw) if isinstance(raw, dict) else None
                obj = self._parse(raw) if key is not None else None
                if key is not None and obj is not None:
                    listing.add(key, obj, resource_version(raw), self._digest(raw) if self._digest is not None else None)
            if listing.token is None:
                break
        self._succeeded()
        self._digests.replace(listing.digests)
        changed = self._store.replace(listing.entries, namespace=self._namespace)
        if changed:
            self._sink.changed(changed, at=self._clock())
        return listing.version

    async def _watch_once(self, state: WatchState) -> None:
        """One watch connection; returns when the server ends it, raises on a drop or 410."""
        try:
            await self._stream(state)
        except KubeError as exc:
            # Some servers answer an expired version with HTTP 410 instead of an ERROR event.
            if exc.gone:
                raise _Gone(exc.reason or "Gone") from exc
            raise

    async def _stream(self, state: WatchState) -> None:
        async with self._kube.watch(
            self._resource,
            namespace=self._namespace,
            resource_version=state.resource_version,
            label_selector=self._options.label_selector,
            timeout_seconds=self._options.watch_seconds,
            silence_timeout=self._options.silence_timeout,
        ) as stream:
            self._reconnects.opened(self._clock())
            self._succeeded()
            buffer = b""
            # Split lines ourselves: StreamReader.readline caps the line length, objects do not.
            async for chunk in stream.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._handle(state.feed(line))
                self._succeeded()
            if buffer.strip():
                self._handle(state.feed(buffer))

    def _handle(self, item: Event | Bookmark | Relist | None) -> None:
        if isinstance(item, Relist):
            raise _Gone(item.reason)
        if isinstance(item, Event):
            key = object_key(item.object)
            if key is None:
                return
            digest = self._digest(item.object) if self._digest is not None and item.type != "DELETED" else None
            what_changed = self._digests.compare(key, digest)
            if what_changed is Changed.NOTHING:
                self._store.touch(key, resource_version(item.object))
                return
            held = self._store.get(key)
            if item.type == "DELETED":
                obj = None
            elif what_changed is Changed.OWN_VERDICT and self._restatus is not None and held is not None:
                obj = self._restatus(held, item.object)
            else:
                obj = self._parse(item.object)
            alike = False
            if obj is None:
                self._digests.note(key, None)
                changed = self._store.delete(key)
            else:
                self._digests.note(key, digest)
                # Our own condition alone changed (nearly always the echo of our write): the
                # status writer reads it from the Store; no decision changes, and parsing the map
                # as valid or not is part of the decision.
                alike = what_changed is Changed.OWN_VERDICT and type(obj) is type(held)
                changed = self._store.upsert(key, obj, resource_version(item.object), decided_alike=alike)
            if not changed:
                return
            if alike:
                self._sink.reported((key,))
            else:
                self._sink.changed((key,), at=self._clock())
