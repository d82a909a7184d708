"""The engine: the one owner of gateway state, whatever the gateway.

A gateway is a pure Renderer plus a Transport (adapters.base). The engine keeps each confirmed
map's route and rendered part (re-rendering only what changed), who owns each hostname, and the
snapshot of what the gateway last confirmed, which only a confirmed write or a read-back of what
the gateway serves replaces. A write the gateway refuses as a whole is bisected down to the maps
that cause it, so one bad map never blocks the others. One task drives it, one call at a time; it
decides nothing about TrafficMaps and logs nothing: it returns what happened.

Hostnames are decided here, once, for every gateway (the bookkeeping is adapters.hostnames, a pure
value the engine owns and tells each confirmed change): the map serving a hostname keeps it until its
own change away from it is confirmed; only then, in a later write of the same apply, is the
hostname granted to a claimant (the older TrafficMap, then namespace/name). So no write, and no
half of a bisected write, ever puts two maps on one hostname, whatever the gateway refuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic

from adapters.base import (
    ApplyResult,
    NotConnected,
    PagedRead,
    PartT,
    Reconciled,
    Rejected,
    Renderer,
    Transport,
    Unavailable,
    WriteResult,
    publication_problem,
)
from adapters.hostnames import Hostnames
from publisher.core.values import Held, MapKey, Publication, Reason, Route

__all__ = ["Engine"]

# Rendering a map takes 5-15 us (Envoy's resources the most): 10,000 maps held the event loop
# 100-170 ms in one turn. A read-back (which renders again only the maps that differ from the
# confirmed ones) and a write's rendering give the loop back after each slice of this many maps.
RENDER_SLICE = 256


@dataclass
class _Written:
    """What a run of transport writes did, gathered across a bisection."""

    rejected: dict[MapKey, Held] = field(default_factory=dict)
    notes: dict[MapKey, str] = field(default_factory=dict)
    wrote: bool = False
    reloads: int = 0


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
        # Who serves and owns each hostname, and the claims waiting for one.
        self._hostnames = Hostnames()
        # Confirmed maps some client refuses: written again with their next decision.
        self._refused: dict[MapKey, Held] = {}
        # Maps of a write whose outcome is unknown: clients may disagree on them, so they are
        # decided again and written even when the read-back shows their route unchanged.
        self._in_doubt: set[MapKey] = set()
        # Maps a read-back changed, or left in doubt, not yet handed back to be decided again
        # (kept across a call that raised after its read-back).
        self._redecide: set[MapKey] = set()
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
        self._redecide.clear()  # the caller decides every map read back
        return self.confirmed

    async def apply(self, decided: Mapping[MapKey, Publication | None]) -> ApplyResult:
        """Make the gateway serve each decided map's route (None: withdraw it), writing only the
        maps whose route differs from the confirmed one, that a client refuses, or that a write
        in doubt left the clients disagreeing on; and withdrawing a map read back on a hostname an
        older map holds.

        Raises Unavailable when the gateway cannot be reached or did not confirm; what it then
        serves is read back before the next write. Everything else comes back in the result.
        """
        if self._unknown:
            await self._read_back()
        for key, pub in decided.items():
            if pub is not None:
                self._hostnames.record_created(key, pub.created)
        rejected: dict[MapKey, Held] = {}
        wanted: dict[MapKey, Route | None] = {}
        for key, pub in decided.items():
            self._hostnames.stop_waiting(key)
            route = pub.route if pub is not None else None
            if route != self._routes.get(key) or key in self._refused or key in self._in_doubt:
                wanted[key] = route
        # A map in doubt that is not decided now is written as confirmed, so the clients converge.
        for key in self._in_doubt - wanted.keys():
            if key in self._routes:
                wanted[key] = self._routes[key]
        self._hostnames.settle_duplicates(wanted, self._routes, rejected)
        written = _Written()
        # Each round writes the changes that depend on no unwritten change; a claim on a hostname
        # that a change frees waits for the round after the freeing write is confirmed.
        broken: MapKey | None = None
        while wanted:
            ready, wanted, withdrawn = self._hostnames.next_round(wanted, self._routes, rejected, may_break=broken is None)
            if broken is None:
                broken = withdrawn
            if ready:
                await self._render_and_write(ready, rejected, written)
        rejected.update(written.rejected)
        released = self._hostnames.release(rejected, broken)
        released.update(key for key in self._redecide if key not in decided)
        self._redecide.clear()
        return ApplyResult(rejected, written.notes, frozenset(released), written.wrote, written.reloads)

    async def reconcile(self) -> Reconciled:
        """Read back what the gateway serves and write back whatever drifted from the confirmed
        snapshot. The snapshot is never replaced by the read: the gateway is ours, so what we
        confirmed is what it must serve. After a write whose outcome is unknown, though, the read
        is the snapshot, and the maps it changed are to be decided again."""
        if self._unknown:
            await self._read_back()
            released, self._redecide = frozenset(self._redecide), set()
            # Kept as every refusal is, so the map is written again (and not reported published)
            # until the client takes it.
            refused = self._take_refusals()
            self._refused.update(refused)
            return Reconciled(refused=refused, released=released)
        served = await self._transport.read()
        return await self._repair(self._drift(served, self._routes.keys()))

    @property
    def reads_in_pages(self) -> bool:
        return isinstance(self._transport, PagedRead)

    async def reconcile_page(self, keys: Collection[MapKey], *, last: bool) -> Reconciled:
        """`reconcile` for the maps of `keys` alone; the `last` page of a resync also reads what
        the gateway serves besides the maps the engine holds. A gateway whose state is unknown,
        or that cannot read a page, is read back whole."""
        transport = self._transport
        if self._unknown or not isinstance(transport, PagedRead):
            return await self.reconcile()
        served = await transport.read_page(keys)
        if last:
            served.update(await transport.read_others(self._routes.keys()))
        return await self._repair(self._drift(served, keys))

    def _drift(self, served: Mapping[MapKey, Route], read: Iterable[MapKey]) -> set[MapKey]:
        """The maps whose route in `served` is not the confirmed one, and the confirmed maps of
        `read` (the maps the read covered) that `served` lacks. A served route is mostly the very
        Route confirmed (the transport gives back what it was given): identity first, so 10,000
        unchanged maps compare nothing field by field."""
        routes = self._routes
        drift = {key for key, route in served.items() if (confirmed := routes.get(key)) is not route and confirmed != route}
        drift.update(key for key in read if key in routes and key not in served)
        return drift

    async def _repair(self, drift: set[MapKey]) -> Reconciled:
        """Write back what `drift` names as the engine confirmed it; hold what a client refuses."""
        refused = self._take_refusals()
        repair_in_doubt = self._in_doubt & self._routes.keys()
        if drift or repair_in_doubt:
            repair = {key: self._parts.get(key) for key in drift | repair_in_doubt}
            try:
                result = await self._transport.write(_Overlay(self._parts, {}), repair)
            except NotConnected:
                raise
            except Unavailable:
                self._unknown = True
                self._in_doubt.update(repair)
                raise
            self._in_doubt -= repair.keys() - result.rejected.keys()
            drift -= result.rejected.keys()
            refused.update((key, self._refusal(key, why)) for key, why in result.rejected.items() if key in self._routes)
            refused.update((key, self._refusal(key, why)) for key, why in result.held_back.items() if key in self._routes)
            refused.update(self._take_refusals())
        repaired = frozenset(drift - refused.keys())
        for key in repaired:
            self._refused.pop(key, None)
        self._refused.update(refused)
        return Reconciled(repaired, refused)

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
        """Replace the snapshot with what the gateway serves; the maps whose route changed, and
        those of the write in doubt, are to be decided again."""
        served = await self._transport.read()
        routes: dict[MapKey, Route] = {}
        parts: dict[MapKey, PartT] = {}
        changed: set[MapKey] = set()
        # Yielding is safe: the applier is the engine's only caller, so nothing changes the
        # engine's state meanwhile, and readers of `confirmed` see the old snapshot until the end.
        for count, (key, route) in enumerate(served.items(), 1):
            if count % RENDER_SLICE == 0:
                await asyncio.sleep(0)
            if key in self._parts and self._routes.get(key) == route:
                parts[key] = self._parts[key]  # a part is a pure function of its route: kept
            else:
                try:
                    parts[key] = self._renderer.render(key, route)
                except Exception:  # noqa: BLE001 - a route we cannot render again is not ours to keep
                    continue
                changed.add(key)
            routes[key] = route
        changed |= self._routes.keys() - routes.keys()
        self._routes, self._parts = routes, parts
        self._hostnames.rebuild(routes)
        self._refused = {key: held for key, held in self._refused.items() if key in routes}
        self._unknown = False
        self._redecide |= changed | self._in_doubt
        # What no client serves is settled; what some serve is written again until they agree.
        self._in_doubt &= routes.keys()

    async def _render_and_write(self, wanted: Mapping[MapKey, Route | None], rejected: dict[MapKey, Held], written: _Written) -> None:
        parts: dict[MapKey, PartT | None] = {}
        for count, (key, route) in enumerate(wanted.items(), 1):
            if count % RENDER_SLICE == 0:
                await asyncio.sleep(0)  # safe: only the applier calls the engine, and this changes no state yet
            if route is None:
                if key in self._parts:
                    parts[key] = None
                continue
            try:
                parts[key] = self._renderer.render(key, route)
            except Exception as exc:  # noqa: BLE001 - one map's failure must not stop the others
                rejected[key] = Held(Reason.INTERNAL_ERROR, f"rendering for the {self.name} gateway failed: {type(exc).__name__}: {exc}")
        if parts:
            await self._write(parts, wanted, written)

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
        except NotConnected:
            raise  # nothing was written: what the gateway serves is still known
        except Unavailable:
            self._unknown = True
            self._in_doubt.update(changes)
            raise
        written.wrote = True
        written.reloads += result.reloads
        written.notes.update(result.notes)
        for key, why in result.rejected.items():
            written.rejected[key] = self._refusal(key, why)
        for key, part in changes.items():
            if key in result.rejected:
                continue
            self._commit(key, routes.get(key), part)
        # Served by the clients that took them: confirmed, and refused until every client takes them.
        held_back = {key: self._refusal(key, why) for key, why in result.held_back.items()}
        self._refused.update(held_back)
        written.rejected.update(held_back)
        late = self._take_refusals()
        self._refused.update(late)
        written.rejected.update(late)

    def _refusal(self, key: MapKey, why: str | Held) -> Held:
        return why if isinstance(why, Held) else Held(Reason.APPLY_FAILED, f"the {self.name} gateway refused it: {why}")

    def _take_refusals(self) -> dict[MapKey, Held]:
        """The refusals clients made outside a write, of maps the gateway is confirmed to serve."""
        return {key: self._refusal(key, why) for key, why in self._transport.refusals().items() if key in self._routes}

    def _commit(self, key: MapKey, route: Route | None, part: PartT | None) -> None:
        self._refused.pop(key, None)
        self._in_doubt.discard(key)
        served = route if part is not None else None
        self._hostnames.commit(key, self._routes.get(key), served)
        if served is None:
            self._routes.pop(key, None)
            self._parts.pop(key, None)
            return
        self._routes[key] = served
        self._parts[key] = part


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
