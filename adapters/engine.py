"""The engine: the one owner of gateway state, whatever the gateway.

A gateway is a pure Renderer plus a Transport (adapters.base). The engine keeps each confirmed
map's route and rendered part (re-rendering only what changed), who owns each hostname, and the
snapshot of what the gateway last confirmed, which only a confirmed write or a read-back of what
the gateway serves replaces. A write the gateway refuses as a whole is bisected down to the maps
that cause it, so one bad map never blocks the others. One task drives it, one call at a time; it
decides nothing about TrafficMaps and logs nothing: it returns what happened.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic

from adapters.base import ApplyResult, PartT, Rejected, Renderer, Transport, Unavailable, WriteResult, publication_problem
from publisher.model import Held, MapKey, Publication, Reason, Route

__all__ = ["Engine"]


@dataclass
class _Written:
    """What a run of transport writes did, gathered across a bisection."""

    rejected: dict[MapKey, Held] = field(default_factory=dict)
    notes: dict[MapKey, str] = field(default_factory=dict)
    wrote: bool = False
    reloads: int = 0
    # Hostnames no map owns any more: maps waiting for one of them are released.
    freed: set[str] = field(default_factory=set)


class Engine(Generic[PartT]):
    """A gateway behind the loop's one interface: `check`, `start`, `apply`, `reconcile`.

    `confirmed` is what the gateway serves as far as the engine can prove: the loop compares its
    desired routes against it, so an unchanged route (a generation-only change) writes nothing.
    """

    def __init__(self, name: str, renderer: Renderer[PartT], transport: Transport[PartT]) -> None:
        self.name = name
        self._renderer = renderer
        self._transport = transport
        self._routes: dict[MapKey, Route] = {}
        self._parts: dict[MapKey, PartT] = {}
        self._owners: dict[str, MapKey] = {}
        self._waiting: dict[MapKey, str] = {}
        # The gateway's state must be read before the next write: at start, and after a write
        # whose outcome is unknown.
        self._unknown = True

    @property
    def confirmed(self) -> Mapping[MapKey, Route]:
        return MappingProxyType(self._routes)

    @property
    def transport(self) -> Transport[PartT]:
        return self._transport

    def check(self, pub: Publication) -> Held | None:
        """Pure: the shared strict checks, then what this gateway cannot express."""
        problem = publication_problem(pub) or self._renderer.problem(pub.key, pub.route)
        return Held(Reason.INVALID_PLAN, problem) if problem is not None else None

    async def start(self) -> Mapping[MapKey, Route]:
        """Read back what the gateway serves: the starting state after a restart."""
        await self._read_back()
        return self.confirmed

    async def apply(self, changes: Mapping[MapKey, Publication | None]) -> ApplyResult:
        """Make the gateway serve each changed map's route (None: withdraw it).

        Raises Unavailable when the gateway cannot be reached or did not confirm; what it then
        serves is read back before the next write. Everything else comes back in the result.
        """
        if self._unknown:
            await self._read_back()
        rejected: dict[MapKey, Held] = {}
        wanted: dict[MapKey, Route | None] = {}
        for key, pub in changes.items():
            self._waiting.pop(key, None)
            route = pub.route if pub is not None else None
            if route != self._routes.get(key):
                wanted[key] = route
        losers = self._host_conflicts(wanted, {key: pub.created for key, pub in changes.items() if pub is not None})
        for key, (hostname, owner) in losers.items():
            del wanted[key]
            self._waiting[key] = hostname
            rejected[key] = Held(
                Reason.HOST_CONFLICT,
                f"hostname {hostname} is already served for {owner}; this map is published once {owner} lets it go",
            )
        parts: dict[MapKey, PartT | None] = {}
        for key, route in wanted.items():
            if route is None:
                parts[key] = None
                continue
            try:
                parts[key] = self._renderer.render(key, route)
            except Exception as exc:  # noqa: BLE001 - one map's failure must not stop the others
                rejected[key] = Held(Reason.INTERNAL_ERROR, f"rendering for the {self.name} gateway failed: {type(exc).__name__}: {exc}")
        changed = {key: part for key, part in parts.items() if key in self._parts or part is not None}
        written = _Written()
        if changed:
            await self._write(changed, wanted, written)
        rejected.update(written.rejected)
        freed = written.freed
        released = frozenset(key for key, hostname in self._waiting.items() if hostname in freed and key not in rejected)
        for key in released:
            del self._waiting[key]
        return ApplyResult(rejected, written.notes, released, written.wrote, written.reloads)

    async def reconcile(self) -> frozenset[MapKey]:
        """Read back what the gateway serves and write back whatever drifted from the confirmed
        snapshot. Returns the maps that had drifted. The snapshot is never replaced by the read:
        the gateway is ours, so what we confirmed is what it must serve."""
        served = await self._transport.read()
        drift = frozenset(key for key in self._routes.keys() | served.keys() if served.get(key) != self._routes.get(key))
        if drift:
            repair = {key: self._parts.get(key) for key in drift}
            try:
                await self._transport.write(_Overlay(self._parts, {}), repair)
            except Unavailable:
                self._unknown = True
                raise
        return drift

    def hold_off(self) -> float:
        return self._transport.hold_off()

    def unready(self) -> str | None:
        return self._transport.unready()

    async def serve(self) -> None:
        await self._transport.serve()

    async def aclose(self) -> None:
        await self._transport.aclose()

    # --- internals ----------------------------------------------------------------------------

    async def _read_back(self) -> None:
        served = await self._transport.read()
        routes: dict[MapKey, Route] = {}
        parts: dict[MapKey, PartT] = {}
        for key, route in served.items():
            try:
                parts[key] = self._renderer.render(key, route)
            except Exception:  # noqa: BLE001 - a route we cannot render again is not ours to keep
                continue
            routes[key] = route
        self._routes, self._parts = routes, parts
        self._owners = {}
        for key in sorted(routes):
            self._owners.setdefault(routes[key].hostname, key)
        self._unknown = False

    def _host_conflicts(
        self, wanted: Mapping[MapKey, Route | None], created: Mapping[MapKey, str]
    ) -> dict[MapKey, tuple[str, MapKey]]:
        """Maps that ask for a hostname another map keeps: {loser: (hostname, owner)}.

        The map serving a hostname keeps it unless it leaves it in this same apply; among new
        claims the oldest TrafficMap wins, then namespace/name, so a restart decides the same."""
        claims: dict[str, list[MapKey]] = {}
        for key, route in wanted.items():
            if route is not None:
                claims.setdefault(route.hostname, []).append(key)
        losers: dict[MapKey, tuple[str, MapKey]] = {}
        for hostname, claimants in claims.items():
            owner = self._owners.get(hostname)
            if owner is not None and owner not in claimants:
                leaving = owner in wanted
                if not leaving:
                    losers.update((key, (hostname, owner)) for key in claimants)
                    continue
            if owner is None or owner not in claimants:
                owner = min(claimants, key=lambda key: (created.get(key, ""), key))
            losers.update((key, (hostname, owner)) for key in claimants if key != owner)
        return losers

    async def _write(self, changes: dict[MapKey, PartT | None], routes: Mapping[MapKey, Route | None], written: _Written) -> None:
        """One transport write of `changes`; a refusal of several maps is bisected so only the
        maps the gateway refuses on their own stay out."""
        try:
            result: WriteResult = await self._transport.write(_Overlay(self._parts, changes), changes)
        except Rejected as exc:
            if len(changes) == 1:
                (key,) = changes
                written.rejected[key] = Held(Reason.APPLY_FAILED, f"the {self.name} gateway refused it: {exc}")
                return
            keys = sorted(changes)
            half = len(keys) // 2
            for part in (keys[:half], keys[half:]):
                await self._write({key: changes[key] for key in part}, routes, written)
            return
        except Unavailable:
            self._unknown = True
            raise
        written.wrote = True
        written.reloads += result.reloads
        written.notes.update(result.notes)
        for key, why in result.rejected.items():
            written.rejected[key] = why if isinstance(why, Held) else Held(Reason.APPLY_FAILED, f"the {self.name} gateway refused it: {why}")
        for key, part in changes.items():
            if key in result.rejected:
                continue
            self._commit(key, routes.get(key), part, written.freed)

    def _commit(self, key: MapKey, route: Route | None, part: PartT | None, freed: set[str]) -> None:
        old = self._routes.get(key)
        if old is not None and self._owners.get(old.hostname) == key:
            del self._owners[old.hostname]
            freed.add(old.hostname)
        if route is None or part is None:
            self._routes.pop(key, None)
            self._parts.pop(key, None)
            return
        self._routes[key] = route
        self._parts[key] = part
        self._owners[route.hostname] = key
        freed.discard(route.hostname)


class _Overlay(Mapping[MapKey, Any]):
    """`base` with `changes` on top, None meaning removed: every map's part after a write, as a
    view, so a write of one map never copies 10,000."""

    def __init__(self, base: Mapping[MapKey, Any], changes: Mapping[MapKey, Any]) -> None:
        self._base = base
        self._changes = changes

    def __getitem__(self, key: MapKey) -> Any:
        if key in self._changes:
            value = self._changes[key]
            if value is None:
                raise KeyError(key)
            return value
        return self._base[key]

    def __iter__(self) -> Iterator[MapKey]:
        for key in self._base:
            if key not in self._changes or self._changes[key] is not None:
                yield key
        for key, value in self._changes.items():
            if key not in self._base and value is not None:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)
