"""The Publisher: the loop that wires source -> gate -> verify -> plan -> engine -> report.

Owns the applier's KeyQueue (the dirty keys), the resync backlog, whether the source delivered its
first full view (`is_synced`) and whether the gateway was read back (`started`), and the served-split
check it was given (`split`). Its parts own the rest, one job each: deciding (decide.py, pure), the
calls to the engine (gateway.py), settling a pass into map states, counts and verdicts (settle.py),
the status outbox with its delay and leader gate (outbox.py), and the /debug/maps view (debug.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from adapters.base import Adapter
from publisher import metrics, status
from publisher.core.values import MapKey, Publication, Route
from publisher.core.plan import Outcome
from publisher.loop.debug import debug_maps
from publisher.loop.decide import Decisions, engine_batch
from publisher.loop.gateway import Gateway
from publisher.loop.keys import KeyQueue, ResyncBacklog
from publisher.loop.options import DECIDE_SLICE, RESYNC_REST_CAP, STATUS_YIELD_CAP, LoopOptions
from publisher.loop.outbox import StatusOutbox
from publisher.loop.settle import Settler
from publisher.loop.states import MapStates
from publisher.source.store import Stores
from publisher.split.check import SplitVerifier


class Publisher:
    """Decides maps, applies them through the gateway engine, and queues reports.

    A source fills the Stores and marks keys dirty (`changed`). One applier takes every dirty key
    at once, decides each map from the newest objects, and hands the engine every decision in one
    apply: a burst costs one write. The applier is the only caller of the engine: resync is a
    request it serves between passes, so a read-back never runs beside a write. The engine's
    confirmed routes are what the gateway serves; `provenance` records which Publication
    (generation) each came from."""

    def __init__(
        self,
        stores: Stores,
        adapter: Adapter,
        options: LoopOptions,
        *,
        status_sink: status.StatusSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.stores = stores
        self.adapter = adapter
        self.options = options
        self.clock = clock
        self.wall_clock = wall_clock
        self.queue = KeyQueue(clock)
        self.resync = ResyncBacklog(self.queue, pages=adapter.reads_in_pages)
        self.decisions = Decisions(stores, options, adapter.check)
        self.gateway = Gateway(adapter, options, clock)
        # Clear while the applier is in a pass: the status writer's cue (see gateway_turn).
        self.applier_idle = asyncio.Event()
        self.applier_idle.set()
        self.outbox = StatusOutbox(status_sink, options, clock, self.gateway_turn)
        self.settler = Settler(stores, adapter, options, self.queue, self.outbox, clock, wall_clock)
        self.is_synced = False
        self.synced_event = asyncio.Event()
        self.started = False
        self.gc_threshold = gc.get_threshold()  # restored once the first sync is done
        # What the source says is wrong (a refusal, an unreachable server), for /readyz.
        self.source_problem: Callable[[], str | None] = lambda: None
        # The served-split check, where the gateway counts requests and it is on.
        self.split: SplitVerifier | None = None

    @property
    def published(self) -> Mapping[MapKey, Route]:
        """What the gateway serves, as the engine last confirmed it."""
        return self.adapter.confirmed

    @property
    def states(self) -> MapStates:
        """What the loop last decided for each map."""
        return self.settler.states

    @property
    def provenance(self) -> Mapping[MapKey, Publication]:
        """The Publication each route the gateway serves came from."""
        return self.settler.provenance

    # --- ChangeSink ---------------------------------------------------------------------------

    def changed(self, keys: Iterable[MapKey], *, at: float) -> None:
        for key in keys:
            self.queue.add(key, at)

    def reported(self, keys: Iterable[MapKey]) -> None:
        """Only our condition changed on these maps (nearly always the echo of our own write): no
        decision can differ, so the applier is not woken; the status writer compares each
        verdict with the condition, and writes it again if someone else edited it."""
        self.outbox.compare(keys)

    def synced(self) -> None:
        """The source has delivered its first full view: from now on absence means withdrawal."""
        self.is_synced = True
        self.synced_event.set()
        for key in self.all_keys():
            self.queue.add(key)

    # --- one pass ------------------------------------------------------------------------------

    def decide(self, key: MapKey) -> Outcome:
        return self.decisions(key)

    async def sync_once(self, pending: Mapping[MapKey, float | None]) -> None:
        """One pass over the dirty keys in `pending`: decide each (gate -> verify -> plan), hand
        every decision to the engine in one apply (it writes what changed), settle the result into
        map states, metrics and the verdicts the status outbox writes."""
        if not pending:
            return
        outcomes = await self._decide_all(pending)
        batch = engine_batch(outcomes, self.adapter.confirmed, self.settler.failing)
        applied = await self.gateway.apply(batch)
        if applied.failure is None:
            await self.settler.record(batch.before, applied.result, pending, self.split)
            self.gateway.passed(batch, applied.result, maps_pending=self.states.count("pending"))
        await self.settler.settle_pass(outcomes, batch, applied, self.split)

    async def _decide_all(self, pending: Iterable[MapKey]) -> dict[MapKey, Outcome]:
        """Each map's decision; an unexpected error holds that map alone (InternalError)."""
        outcomes: dict[MapKey, Outcome] = {}
        for count, key in enumerate(pending, 1):
            try:
                outcomes[key] = self.decide(key)
            except Exception as exc:  # noqa: BLE001 - the boundary: one map must not stop the others
                outcomes[key] = self.settler.internal_error(key, "deciding", exc)
            if count % DECIDE_SLICE == 0:
                await asyncio.sleep(0)  # a first pass of 10,000 maps lets the gateway's tasks and the server run
        return outcomes

    # --- scheduling ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read back what the gateway serves: the starting state after a restart. The source may
        be listing meanwhile; each map read back is queued too, so one the source no longer has is
        withdrawn even when its first full view came first. A gateway with no client connected
        yet is waited for, retrying with backoff."""
        served = await self.gateway.read_back()
        for count, (key, route) in enumerate(served.items(), 1):
            metrics.map_weights(key, route)
            if self.split is not None:
                self.split.route_confirmed(key, route)
            self.queue.add(key)
            if count % DECIDE_SLICE == 0:
                await asyncio.sleep(0)  # 10,000 maps' series took 10-25 ms in one turn
        self.started = True

    def all_keys(self) -> set[MapKey]:
        return set(self.stores.maps.keys()) | set(self.published)

    async def run_applier(self) -> None:
        """Forever: take every dirty key, sync them in one pass. Nothing before the first sync.
        A resync that fell due is served here, between two passes, never beside one."""
        await self.synced_event.wait()
        try:
            await self._apply_forever()
        finally:
            self.applier_idle.set()

    async def _apply_forever(self) -> None:
        self.applier_idle.clear()
        await self.sync_once(self.queue.take_ready())
        # The first full view is long-lived: freezing it keeps every later full collection from
        # walking 10,000 maps (a pause of about 200 ms each) while events wait. No collection
        # first: it would be such a walk (300-375 ms at 10,000 maps), and until the first sync
        # the heap only grew (what cyclic garbage start-up made died young and was collected).
        gc.freeze()
        gc.set_threshold(*self.gc_threshold)
        while True:
            self.applier_idle.set()
            await self.queue.wait()
            self.applier_idle.clear()
            hold_off = self.adapter.hold_off()
            if hold_off > 0:
                await asyncio.sleep(hold_off)
            started = self.clock()
            if self.resync.take_reconcile():
                await self.reconcile()
            page = self.resync.take_page()
            if page is not None:
                await self.reconcile(page)
            await self.sync_once(self.queue.take_ready())
            if len(self.resync):
                # A resync is background work: before its next slice the applier rests as long as
                # this pass took, so a resync of 10,000 maps leaves the event loop idle half the
                # time instead of busy for half a second (yielding, but saturated). A fresh change
                # ends the rest: it is taken at once, and the slice waits for an empty queue.
                self.applier_idle.set()
                await self.queue.wait(min(self.clock() - started, RESYNC_REST_CAP))
            self.resync.feed()

    async def gateway_turn(self) -> None:
        """Until the applier has finished its pass and waits for work (at most STATUS_YIELD_CAP):
        status writes start between gateway writes, not beside them."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STATUS_YIELD_CAP):  # not wait_for: it may swallow a cancellation
                await self.applier_idle.wait()

    async def reconcile(self, page: tuple[Collection[MapKey], bool] | None = None) -> None:
        """Read the gateway back (a `page` of maps, with whether it is a resync's last, or the
        whole gateway) and write back whatever drifted from what it confirmed; hold what a client
        refuses, and decide again what a read-back changed."""
        done = await self.gateway.reconcile(page)
        if done is None:
            return
        for key in done.released:
            self.queue.add(key)
        self.settler.settle_rejected(done.refused, self.split)

    async def run_resync(self) -> None:
        """Periodically ask the applier to repair drift and re-decide every map."""
        while True:
            await asyncio.sleep(self.options.resync)
            if self.is_synced:
                self.resync_now()

    def resync_now(self) -> None:
        """Ask the applier to repair drift and re-decide every map; the status is repaired as the
        gateway is: the sink reads what the server holds again, and each verdict is compared with
        it as its map is settled (once: queueing them all here too compared each twice)."""
        self.resync.request(self.all_keys())
        if self.outbox.leading:
            self.outbox.stale()

    def split_changed(self, key: MapKey) -> None:
        """A map's served split turned off or back: decide it again, so its condition says so."""
        self.queue.add(key)

    # --- health -------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.started

    def ready(self) -> tuple[bool, str]:
        """Ready once the gateway was read, the source gave its first full view and the gateway
        confirmed a pass. After that the API server plays no part (fail static: the gateway keeps
        serving what it holds); only a gateway that confirms no write or read-back for three
        resync intervals makes it unready (one that cannot be read meanwhile keeps serving)."""
        unready = self.adapter.unready()
        waiting = self.gateway.waiting
        if not self.started:
            why = waiting or unready
            return False, f"gateway not read yet: {why}" if why else "gateway not read yet"
        if unready is not None and not (self.options.ready_without_gateway and self.is_synced):
            return False, unready
        if unready is not None:
            return True, f"ready; {unready}"
        if waiting is not None:
            return False, f"waiting for the gateway: {waiting}"
        if not self.is_synced:
            problem = self.source_problem()
            return False, f"waiting for the first sync: {problem}" if problem else "waiting for the first sync"
        if self.gateway.last_success is None:
            return False, "no successful sync yet"
        age = self.clock() - self.gateway.last_success
        if age > 3 * self.options.resync:
            return False, f"last successful sync {age:.0f}s ago"
        notes = []
        problem = self.source_problem()
        if problem:
            notes.append(f"the gateway keeps serving while the source fails: {problem}")
        if self.outbox.problem is not None and self.outbox.leading:
            notes.append(f"status is not written: {self.outbox.problem}")
        return True, f"ready; {'; '.join(notes)}" if notes else "ready"

    def debug_maps(self) -> list[dict[str, Any]]:
        fleet = getattr(self.adapter, "transport", None)
        return debug_maps(
            self.all_keys() | set(self.states),
            states=self.states,
            published=self.published,
            provenance=self.provenance,
            objects=self.stores.maps.get,
            wall_clock=self.wall_clock,
            adapter_name=self.adapter.name,
            served_by=fleet.served if isinstance(fleet, metrics.EnvoyFleet) else None,
            split=self.split,
        )
