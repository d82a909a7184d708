"""The Stores: the newest object per key, the maps indexed by the InferenceService each names, and
what a source tells the loop (`ChangeSink`): which keys changed."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from publisher.core.model import InferenceService, InvalidObject, TrafficMap
from publisher.core.values import MapKey

MapObject = TrafficMap | InvalidObject
T = TypeVar("T")


class Store(Generic[T]):
    """The newest object per key, with the resourceVersion it was seen at and its revision: a
    number that changes whenever an object is stored that a decision could differ on."""

    def __init__(self) -> None:
        self._objects: dict[MapKey, T] = {}
        self._versions: dict[MapKey, str] = {}
        self._revisions: dict[MapKey, int] = {}
        self._stored = itertools.count()

    def get(self, key: MapKey) -> T | None:
        return self._objects.get(key)

    def version(self, key: MapKey) -> str:
        """The resourceVersion `key` was last seen at ("" when absent)."""
        return self._versions.get(key, "")

    def revision(self, key: MapKey) -> int | None:
        """The revision of `key`'s object (None when absent): equal revisions, equal decisions."""
        return self._revisions.get(key)

    def keys(self) -> Iterable[MapKey]:
        return self._objects.keys()

    def __len__(self) -> int:
        return len(self._objects)

    def upsert(self, key: MapKey, obj: T, version: str, *, decided_alike: bool = False) -> bool:
        """Store `obj`; False when the same version is already held (nothing changed).
        `decided_alike`: `obj` differs from the object held only in what no decision reads (this
        instance's own condition), so the revision stays."""
        if version and self._versions.get(key) == version:
            return False
        self._objects[key] = obj
        self._versions[key] = version
        if not decided_alike or key not in self._revisions:
            self._revisions[key] = next(self._stored)
        return True

    def touch(self, key: MapKey, version: str) -> None:
        """`key` is now at `version`, with no change that matters to us."""
        if key in self._objects:
            self._versions[key] = version

    def delete(self, key: MapKey) -> bool:
        self._versions.pop(key, None)
        self._revisions.pop(key, None)
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

    def upsert(self, key: MapKey, obj: MapObject, version: str, *, decided_alike: bool = False) -> bool:
        old = self.get(key)
        if not super().upsert(key, obj, version, decided_alike=decided_alike):
            return False
        service = service_of(key, obj)
        if old is not None:
            if service_of(key, old) == service:
                # Nearly every event (an echo of our condition, new entries): the index holds
                # this already, and a new set and keys for it would be new to the collector.
                return True
            self._unindex(key, old)
        self._by_service.setdefault(service, set()).add(key)
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
    """What a source tells the loop: these keys changed (`at` is when the change was seen), or
    only this instance's own condition on these maps did (`reported`: nothing to decide, but a
    condition edited by someone else is written again)."""

    def changed(self, keys: Iterable[MapKey], *, at: float) -> None: ...

    def reported(self, keys: Iterable[MapKey]) -> None: ...

    def synced(self) -> None: ...


class MappedOnly:
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

    def reported(self, keys: Iterable[MapKey]) -> None:
        """An InferenceService carries no condition of ours: nothing to pass on."""

    def synced(self) -> None:
        self._sink.synced()
