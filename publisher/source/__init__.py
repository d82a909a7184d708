"""Sources of TrafficMaps and InferenceServices, and the Store of the newest object per key.

`KubeSource` (client-go informer semantics: paginated list, watch with bookmarks, relist on 410;
transient faults retried with backoff that resets after a healthy watch, refusals named with
the missing RBAC rule) and `DirectorySource` (manifests in a directory) fill the same Stores and
say which keys changed. Fail static: only a list that succeeds replaces what a Store holds.
A TrafficMap event whose only change is other instances' conditions (other regions' verdicts,
with their managedFields) is recognised by a digest and only moves the Store's resourceVersion.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import pydantic_core
from pydantic import ValidationError

from publisher import metrics
from publisher.kube import INFERENCE_SERVICES, TRAFFIC_MAPS, Kube, KubeError, Resource, decode_json
from publisher.source.manifests import ManifestError, read_manifests
from publisher.core.model import (
    CONDITION_PREFIX,
    INFERENCE_SERVICE_KIND,
    TRAFFIC_MAP_KIND,
    InferenceService,
    InvalidObject,
    MapKey,
    TrafficMap,
    condition_type,
    describe_validation_error,
    object_key,
    parse_traffic_map,
    validate,
)
from publisher.retry import ReconnectBackoff

log = logging.getLogger(__name__)

MapObject = TrafficMap | InvalidObject
T = TypeVar("T")


class Store(Generic[T]):
    """The newest object per key, with the resourceVersion it was seen at."""

    def __init__(self) -> None:
        self._objects: dict[MapKey, T] = {}
        self._versions: dict[MapKey, str] = {}

    def get(self, key: MapKey) -> T | None:
        return self._objects.get(key)

    def version(self, key: MapKey) -> str:
        """The resourceVersion `key` was last seen at ("" when absent)."""
        return self._versions.get(key, "")

    def keys(self) -> Iterable[MapKey]:
        return self._objects.keys()

    def __len__(self) -> int:
        return len(self._objects)

    def upsert(self, key: MapKey, obj: T, version: str) -> bool:
        """Store `obj`; False when the same version is already held (nothing changed)."""
        if version and self._versions.get(key) == version:
            return False
        self._objects[key] = obj
        self._versions[key] = version
        return True

    def touch(self, key: MapKey, version: str) -> None:
        """`key` is now at `version`, with no change that matters to us."""
        if key in self._objects:
            self._versions[key] = version

    def delete(self, key: MapKey) -> bool:
        self._versions.pop(key, None)
        return self._objects.pop(key, None) is not None

    def replace(
        self, objects: Iterable[tuple[MapKey, T, str]], *, namespace: str | None = None
    ) -> set[MapKey]:
        """Make the store hold exactly `objects` (within `namespace`, when given). Returns every key
        that changed, appeared or vanished: a relist is a replace, and a replace yields deletions."""
        changed: set[MapKey] = set()
        seen: set[MapKey] = set()
        for key, obj, version in objects:
            seen.add(key)
            if self.upsert(key, obj, version):
                changed.add(key)
        for key in [k for k in self._objects if k not in seen and (namespace is None or k.namespace == namespace)]:
            self.delete(key)
            changed.add(key)
        return changed


def service_of(key: MapKey, item: MapObject) -> MapKey:
    """The InferenceService a map names (spec.service, in its namespace); an invalid map's is its
    own name, as the loop decides it."""
    return MapKey(key.namespace, item.spec.service if isinstance(item, TrafficMap) else key.name)


class MapStore(Store[MapObject]):
    """The maps, also indexed by the InferenceService each names, so a change of one wakes the
    maps that name it, whatever they are called (O(maps that name it))."""

    def __init__(self) -> None:
        super().__init__()
        self._by_service: dict[MapKey, set[MapKey]] = {}

    def naming(self, service: MapKey) -> frozenset[MapKey]:
        """The maps whose spec.service is `service`."""
        return frozenset(self._by_service.get(service, ()))

    def upsert(self, key: MapKey, obj: MapObject, version: str) -> bool:
        old = self.get(key)
        if not super().upsert(key, obj, version):
            return False
        if old is not None:
            self._unindex(key, old)
        self._by_service.setdefault(service_of(key, obj), set()).add(key)
        return True

    def delete(self, key: MapKey) -> bool:
        old = self.get(key)
        if old is not None:
            self._unindex(key, old)
        return super().delete(key)

    def _unindex(self, key: MapKey, item: MapObject) -> None:
        service = service_of(key, item)
        naming = self._by_service.get(service)
        if naming is not None:
            naming.discard(key)
            if not naming:
                del self._by_service[service]


@dataclass
class Stores:
    maps: MapStore
    isvcs: Store[InferenceService]

    @classmethod
    def empty(cls) -> Stores:
        return cls(maps=MapStore(), isvcs=Store())


class ChangeSink(Protocol):
    """What a source tells the loop: these keys changed (`at` is when the change was seen)."""

    def changed(self, keys: Iterable[MapKey], *, at: float) -> None: ...

    def synced(self) -> None: ...


class _MappedOnly:
    """Passes on, for each changed InferenceService, the keys of the maps that name it in
    spec.service. Any other InferenceService can change no decision (a map's own events cover its
    arrival and deletion), and passing it on would only have the loop decide, and log, the
    withdrawal of nothing."""

    def __init__(self, sink: ChangeSink, maps: MapStore) -> None:
        self._sink = sink
        self._maps = maps

    def changed(self, keys: Iterable[MapKey], *, at: float) -> None:
        mapped = {mapped for key in keys for mapped in self._maps.naming(key)}
        if mapped:
            self._sink.changed(mapped, at=at)

    def synced(self) -> None:
        self._sink.synced()


def _version(raw: dict[str, Any]) -> str:
    return str(raw.get("metadata", {}).get("resourceVersion", ""))


def relevant_digest(raw: dict[str, Any], own_condition: str) -> bytes | None:
    """A digest of what the loop reads of a TrafficMap: all of it but metadata.managedFields and
    .resourceVersion and the conditions of our family that are not `own_condition`. Two events
    with one digest differ only in other instances' verdicts. Our own condition counts: the
    ConditionSink compares with it once the Store's version passes its write.

    None when no other instance has a condition on the map: then an event that changes nothing
    but other instances' verdicts cannot happen, and one region alone pays nothing for the digest
    (22 us an event). The event that brings the first one is parsed in full, once."""
    status = raw.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    if not isinstance(conditions, list) or not any(_foreign(c, own_condition) for c in conditions):
        return None
    view = dict(raw)
    metadata = raw.get("metadata")
    if isinstance(metadata, dict):
        view["metadata"] = {k: v for k, v in metadata.items() if k not in ("managedFields", "resourceVersion")}
    view["status"] = {**status, "conditions": [c for c in conditions if not _foreign(c, own_condition)]}
    return hashlib.blake2b(pydantic_core.to_json(view), digest_size=16).digest()


def _foreign(condition: Any, own_condition: str) -> bool:
    kind = condition.get("type") if isinstance(condition, dict) else None
    return isinstance(kind, str) and kind.startswith(CONDITION_PREFIX) and kind != own_condition


def parse_isvc(raw: dict[str, Any]) -> InferenceService | None:
    try:
        return validate(InferenceService, raw)
    except ValidationError as exc:
        log.warning("inferenceservice unreadable", extra={"object": str(object_key(raw)), "error": describe_validation_error(exc)})
        return None


# --- The watch protocol, free of I/O -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # ADDED | MODIFIED | DELETED
    object: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Bookmark:
    resource_version: str


@dataclass(frozen=True, slots=True)
class Relist:
    """The watch cannot go on from its version (410 Gone): list again."""

    reason: str


class WatchError(Exception):
    """A watch ERROR event other than 410: reconnect from the last version."""


class WatchState:
    """Tracks the resourceVersion of a watch and turns each line into what it means."""

    def __init__(self, resource_version: str) -> None:
        self.resource_version = resource_version

    def feed(self, line: bytes) -> Event | Bookmark | Relist | None:
        line = line.strip()
        if not line:
            return None
        try:
            event = decode_json(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WatchError(f"undecodable watch line: {line[:200]!r}") from exc
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                return Relist(str(obj.get("reason") or "Expired"))
            raise WatchError(f"watch error {code}: {obj.get('message') if isinstance(obj, dict) else obj}")
        if not isinstance(obj, dict):
            raise WatchError(f"watch event without an object: {line[:200]!r}")
        version = _version(obj)
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return Bookmark(version)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            return Event(kind, obj)
        raise WatchError(f"unknown watch event type {kind!r}")


# --- Kubernetes ---------------------------------------------------------------------------------


class _Gone(Exception):
    pass


# Transient failures of list and watch: retried with capped backoff, logged on the first of a streak.
_TRANSIENT = (KubeError, aiohttp.ClientError, asyncio.TimeoutError, WatchError, ConnectionError)
# Answers that mean our configuration is wrong (a request the server cannot read, e.g. a malformed
# label selector; credentials; RBAC; a missing CRD), not the network.
_REFUSALS = (400, 401, 403, 404)


class SourceRefused(Exception):
    """The API server refused the source for a reason retrying will not fix: 400, 401, 403 or 404.
    The message names the verb, the resource, the namespace and what to change."""


def describe_refusal(exc: KubeError, verb: str, resource: Resource, namespace: str | None) -> str:
    """One line an operator can act on: what was refused, where, and the missing rule."""
    what = f"{verb} {resource.plural}.{resource.group} in {_where(namespace)}"
    if exc.code == 400:
        return f"{what}: 400 BadRequest: {exc.message} (check --label-selector)"
    if exc.code == 401:
        return (
            f"{what}: 401 Unauthorized: the API server did not accept our credentials "
            "(check the kubeconfig's user, or the ServiceAccount token of the pod)"
        )
    if exc.code == 403:
        scope = f"a Role in namespace {namespace} (and its RoleBinding)" if namespace else "a ClusterRole (and its ClusterRoleBinding)"
        return (
            f"{what}: 403 Forbidden: {exc.message}; missing RBAC rule in {scope}: "
            f'apiGroups: ["{resource.group}"], resources: ["{resource.plural}"], verbs: ["get", "list", "watch"]'
        )
    return (
        f"{what}: 404 NotFound: the API server does not serve {resource.api_version} {resource.plural} "
        "(is OME's CustomResourceDefinition installed on this cluster?)"
    )


def _where(namespace: str | None) -> str:
    return f"namespace {namespace}" if namespace else "all namespaces"


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
    # conditions is not parsed or decided (with R regions, R - 1 of every R status events).
    # None: every event is.
    region: str | None = None


class Informer(Generic[T]):
    """List then watch one resource in one namespace (or all), feeding one Store.

    `parse` turns a raw object into what the Store keeps (None: unusable, treated as absent).
    List pages are parsed as they arrive, so the raw objects of only one page are alive at once.
    Nothing the API server does empties the Store: only a list that succeeds replaces it.
    `digest`, when given, says what of an object matters: an event with the digest the Store's
    object was parsed from only moves its resourceVersion.
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
        digest: Callable[[dict[str, Any]], bytes | None] | None = None,
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
        # The digest of each object in the Store from this informer, when `digest` is given.
        self._digests: dict[MapKey, bytes] = {}
        self._backoff = ReconnectBackoff(options.backoff_initial, options.backoff_max, options.backoff_reset)
        self._opened_at: float | None = None
        # For staleness and the operator: when a call last succeeded, and what is wrong now.
        self.last_success: float | None = None
        self.problem: str | None = None
        self._refused: str | None = None
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
                self._connection_ended()
            except _Gone as gone:
                self._connection_ended()
                state = None
                metrics.WATCH_RESTARTS.labels(resource=self._resource.plural, reason="Expired").inc()
                log.info("watch expired, relisting", extra={"resource": self._resource.plural, "namespace": _where(self._namespace), "reason": str(gone)})
                # A storm of 410s relists at the backoff's pace, not in a tight loop.
                await self._sleep(self._backoff.failed())
            except _TRANSIENT as exc:
                self._connection_ended()
                if isinstance(exc, KubeError) and exc.code in _REFUSALS:
                    await self._sleep(self._on_refused(exc, verb))
                else:
                    await self._sleep(self._on_transient(exc, verb))

    def _succeeded(self) -> None:
        self.last_success = self._clock()
        self._success_gauge.set(time.time())
        if self.problem is not None:
            log.info(
                "source recovered",
                extra={"resource": self._resource.plural, "namespace": _where(self._namespace), "after": self.problem},
            )
            self.problem = None
        if self._refused is not None:
            metrics.SOURCE_REFUSED.labels(resource=self._resource.plural, namespace=self._namespace or "").set(0)
            self._refused = None

    def _connection_ended(self) -> None:
        if self._opened_at is not None:
            self._backoff.connected_for(self._clock() - self._opened_at)
            self._opened_at = None

    def _on_transient(self, exc: BaseException, verb: str) -> float:
        reason = exc.reason if isinstance(exc, KubeError) and exc.reason else type(exc).__name__
        metrics.WATCH_RESTARTS.labels(resource=self._resource.plural, reason=reason).inc()
        problem = f"{verb} {self._resource.plural}.{self._resource.group} in {_where(self._namespace)}: {exc}"
        if self.problem is None:
            # The first failure of a streak is news; its repeats are counted, not logged.
            log.warning("watch restarting", extra={"resource": self._resource.plural, "namespace": _where(self._namespace), "verb": verb, "error": str(exc)})
        self.problem = problem
        return self._backoff.failed()

    def _on_refused(self, exc: KubeError, verb: str) -> float:
        message = describe_refusal(exc, verb, self._resource, self._namespace)
        if self._options.refusals_fatal:
            raise SourceRefused(message) from exc
        metrics.SOURCE_REFUSED.labels(resource=self._resource.plural, namespace=self._namespace or "").set(1)
        if message != self._refused:
            log.error("source refused", extra={"resource": self._resource.plural, "namespace": _where(self._namespace), "verb": verb, "error": message})
        self._refused = self.problem = message
        return self._options.refusal_retry

    async def _list(self) -> str:
        entries: list[tuple[MapKey, T, str]] = []
        digests: dict[MapKey, bytes] = {}
        token: str | None = None
        version = ""
        while True:
            page = await self._kube.list(
                self._resource,
                namespace=self._namespace,
                label_selector=self._options.label_selector,
                limit=self._options.page_size,
                continue_token=token,
            )
            if not isinstance(page, dict) or not isinstance(page.get("items") or [], list) or not isinstance(page.get("metadata") or {}, dict):
                # A 2xx that is not a list (a proxy's page that parsed): as transient as no answer.
                raise KubeError(0, "InvalidResponse", f"the list of {self._resource.plural} is not a list of objects")
            entries.extend(self._entries(page.get("items") or (), digests))
            metadata = page.get("metadata") or {}
            if not token:
                version = str(metadata.get("resourceVersion", ""))
            token = metadata.get("continue") or None
            if not token:
                break
        self._succeeded()
        self._digests = digests
        changed = self._store.replace(entries, namespace=self._namespace)
        if changed:
            self._sink.changed(changed, at=self._clock())
        return version

    def _entries(self, items: Iterable[dict[str, Any]], digests: dict[MapKey, bytes]) -> Iterable[tuple[MapKey, T, str]]:
        for raw in items:
            key = object_key(raw) if isinstance(raw, dict) else None
            obj = self._parse(raw) if key is not None else None
            if key is not None and obj is not None:
                digest = self._digest(raw) if self._digest is not None else None
                if digest is not None:
                    digests[key] = digest
                yield key, obj, _version(raw)

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
            self._opened_at = self._clock()
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
            if digest is not None and self._digests.get(key) == digest:
                self._store.touch(key, _version(item.object))
                return
            obj = self._parse(item.object) if item.type != "DELETED" else None
            if obj is None:
                self._digests.pop(key, None)
                changed = self._store.delete(key)
            else:
                if digest is not None:
                    self._digests[key] = digest
                else:
                    self._digests.pop(key, None)
                changed = self._store.upsert(key, obj, _version(item.object))
            if changed:
                self._sink.changed((key,), at=self._clock())


class KubeSource:
    """TrafficMaps and InferenceServices from an API server, per namespace or cluster-wide."""

    def __init__(self, kube: Kube, stores: Stores, sink: ChangeSink, options: WatchOptions, *, clock: Callable[[], float]) -> None:
        self._kube = kube
        self._stores = stores
        self._sink = sink
        self._options = options
        self._clock = clock
        self._pending_sync = 0
        self._informers: list[Informer[Any]] = []
        self._stale = False

    def _make_informers(self) -> list[Informer[Any]]:
        namespaces: tuple[str | None, ...] = self._options.namespaces or (None,)
        informers: list[Informer[Any]] = []
        isvc_sink = _MappedOnly(self._sink, self._stores.maps)
        region = self._options.region
        map_digest = functools.partial(relevant_digest, own_condition=condition_type(region)) if region is not None else None
        for namespace in namespaces:
            for resource, store, parse, sink, digest in (
                (TRAFFIC_MAPS, self._stores.maps, parse_traffic_map, self._sink, map_digest),
                (INFERENCE_SERVICES, self._stores.isvcs, parse_isvc, isvc_sink, None),
            ):
                informers.append(
                    Informer(
                        self._kube,
                        resource,
                        namespace=namespace,
                        options=self._options,
                        store=store,
                        parse=parse,
                        sink=sink,
                        on_synced=self._one_synced,
                        clock=self._clock,
                        digest=digest,
                    )
                )
        return informers

    async def run(self) -> None:
        self._informers = self._make_informers()
        self._pending_sync = len(self._informers)
        started = self._clock()
        try:
            async with asyncio.TaskGroup() as group:
                for informer in self._informers:
                    group.create_task(informer.run())
                group.create_task(self._watch_staleness(started))
        except ExceptionGroup as group:
            # A refusal under --once ends every informer; the caller wants the reason, not a group.
            refused = next((e for e in group.exceptions if isinstance(e, SourceRefused)), None)
            if refused is not None:
                raise refused from None
            raise

    def problem(self) -> str | None:
        """What is wrong with the source now (None: nothing known)."""
        return next((i.problem for i in self._informers if i.problem is not None), None)

    def age(self, since: float) -> float:
        """Seconds since the least recent success of any informer (counted from `since` for one
        that never succeeded)."""
        now = self._clock()
        return max((now - (i.last_success if i.last_success is not None else since) for i in self._informers), default=0.0)

    async def _watch_staleness(self, started: float) -> None:
        """Log once when the source goes stale and once when it is fresh again: the gateway keeps
        serving either way, so this is news for the operator, not a reason to change anything."""
        interval = min(5.0, self._options.stale_after / 4)
        while True:
            await asyncio.sleep(interval)
            age = self.age(started)
            if age > self._options.stale_after and not self._stale:
                self._stale = True
                log.warning("source stale, gateway keeps serving", extra={"age_seconds": round(age), "problem": self.problem()})
            elif age <= self._options.stale_after and self._stale:
                self._stale = False
                log.info("source fresh again")

    def _one_synced(self) -> None:
        self._pending_sync -= 1
        if self._pending_sync == 0:
            self._sink.synced()


# --- A directory of manifests -------------------------------------------------------------------

_MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class _FileState:
    signature: tuple[int, int, int]
    maps: tuple[tuple[MapKey, MapObject, str], ...]
    isvcs: tuple[tuple[MapKey, InferenceService, str], ...]


class DirectorySource:
    """Manifests in one directory (not recursive), re-read when a file's size or mtime changes.

    A file that fails to parse is reported and skipped; the objects it held before stay as they
    were, so its maps keep their last state while the other files' maps move on.
    """

    def __init__(self, path: Path, stores: Stores, sink: ChangeSink, *, clock: Callable[[], float], poll_interval: float = 0.5) -> None:
        self._path = path
        self._stores = stores
        self._sink = sink
        self._clock = clock
        # Half a second keeps a change visible within a second without a filesystem-events dependency.
        self._poll_interval = poll_interval
        self._files: dict[str, _FileState] = {}
        self._bad: dict[str, tuple[tuple[int, int, int], str]] = {}

    def problem(self) -> str | None:
        """The first manifest file skipped now, and why (None: every file was read)."""
        return next((error for _, (_, error) in sorted(self._bad.items())), None)

    async def run(self) -> None:
        await self.scan()
        self._sink.synced()
        while True:
            await asyncio.sleep(self._poll_interval)
            await self.scan()

    async def scan(self) -> None:
        """Read what changed since the last scan, then update the Stores in one step."""
        started = self._clock()
        changed = await asyncio.to_thread(self._scan_files)
        if not changed:
            return
        maps = [item for state in self._files.values() for item in state.maps]
        isvcs = [item for state in self._files.values() for item in state.isvcs]
        map_keys = self._stores.maps.replace(maps)
        # As _MappedOnly: an InferenceService that no map names changes no decision.
        isvc_keys = {mapped for key in self._stores.isvcs.replace(isvcs) for mapped in self._stores.maps.naming(key)}
        keys = map_keys | isvc_keys
        if keys:
            self._sink.changed(keys, at=started)

    def _scan_files(self) -> bool:
        try:
            names = sorted(e.name for e in os.scandir(self._path) if e.is_file() and e.name.endswith(_MANIFEST_SUFFIXES) and not e.name.startswith("."))
        except OSError as exc:
            log.error("manifest directory unreadable", extra={"path": str(self._path), "error": str(exc)})
            return False
        changed = False
        for name in [n for n in self._files if n not in names]:
            del self._files[name]
            changed = True
        for name in [n for n in self._bad if n not in names]:
            del self._bad[name]
        for name in names:
            path = self._path / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            known = self._files.get(name)
            if known is not None and known.signature == signature:
                continue
            if name in self._bad and self._bad[name][0] == signature:
                continue
            try:
                state = self._read(path, signature)
            except (ManifestError, OSError, ValueError) as exc:
                self._bad[name] = (signature, str(exc))
                metrics.SOURCE_ERRORS.labels(source="dir").inc()
                log.error("manifest file skipped", extra={"path": str(path), "error": str(exc)})
                continue
            self._bad.pop(name, None)
            self._files[name] = state
            changed = True
        return changed

    @staticmethod
    def _read(path: Path, signature: tuple[int, int, int]) -> _FileState:
        objects = read_manifests(path)
        maps, isvcs = [], []
        for raw in objects:
            kind, key = raw.get("kind"), object_key(raw)
            if key is None:
                continue
            # An object's content is its version: a rewritten file with the same object is no change.
            version = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
            if kind == TRAFFIC_MAP_KIND:
                maps.append((key, parse_traffic_map(raw), version))
            elif kind == INFERENCE_SERVICE_KIND:
                isvc = parse_isvc(raw)
                if isvc is not None:
                    isvcs.append((key, isvc, version))
        return _FileState(signature, tuple(maps), tuple(isvcs))
