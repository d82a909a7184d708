"""The Publisher: decides maps, applies them through the gateway engine, and queues reports."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from adapters.base import Adapter, AdapterError, ApplyResult, NotConnected
from publisher.core import gate, plan
from publisher import metrics, status
from publisher.split import check as split_check
from publisher.core.model import Held, InvalidObject, MapKey, Publication, Reason, Route, TrafficMap
from publisher.core.plan import Hold, Outcome, Publish, Withdraw
from publisher.retry import Backoff
from publisher.split.check import SplitVerifier
from publisher.source import Stores
from publisher.loop.keys import KeyQueue
from publisher.loop.options import DECIDE_SLICE, PENDING_RETRY_CAP, LoopOptions

log = logging.getLogger("publisher.loop")


@dataclass
class MapState:
    """What the loop last decided for a map, for /debug/maps, metrics and logs."""

    state: str = "pending"  # published | held | withdrawn | pending | failed
    reason: str | None = None
    message: str | None = None


# The status backoff's key for a sink that cannot write at all (one backoff, not one per map).
_WHOLE_SINK = MapKey("", "")


class Publisher:
    """Decides maps, applies them through the gateway engine, and queues reports.

    The applier task is the only caller of the engine: resync is a request it serves between
    batches, so a read-back never runs beside a write. The engine's confirmed routes are what the
    gateway serves; `provenance` records which Publication (generation) each came from."""

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
        self.status_sink = status_sink
        self.clock = clock
        self.wall_clock = wall_clock
        self.queue = KeyQueue(clock)
        self.backoff = Backoff(options.backoff_base, options.backoff_cap)
        self.status_queue = KeyQueue(clock)
        self.status_backoff = Backoff(options.backoff_base, options.backoff_cap)
        self.provenance: dict[MapKey, Publication] = {}
        self.states: dict[MapKey, MapState] = {}
        self.reports: dict[MapKey, status.Report] = {}
        # Since when each map's verdict has been other than published, for status_delay.
        self._unpublished_since: dict[MapKey, float] = {}
        self.is_synced = False
        self.synced_event = asyncio.Event()
        self.started = False
        self.gc_threshold = gc.get_threshold()  # restored once the first sync is done
        self.leading = status_sink is not None
        self.last_success: float | None = None
        self._state_counts: dict[str, int] = {}
        # What the source says is wrong (a refusal, an unreachable server), for /readyz.
        self.source_problem: Callable[[], str | None] = lambda: None
        # Why the gateway cannot be written yet (no client connected), for /readyz; None once it can.
        self.gateway_waiting: str | None = None
        # The stale-probe note last logged per map: a stalled prober is logged once, not per pass.
        self._probe_notes: dict[MapKey, str] = {}
        self._reconcile_due = False
        # Keys a resync re-decides, fed to the queue a slice at a time when it has nothing else,
        # so a resync of 10,000 maps never holds a fresh event back or the event loop up.
        self._resync_backlog: list[MapKey] = []
        # The served-split check, where the gateway counts requests and it is on.
        self.split: SplitVerifier | None = None
        # Why no verdict can be written (a CRD not installed, a permission missing), for /readyz
        # and the log; None while status writes work.
        self.status_problem: str | None = None

    @property
    def published(self) -> Mapping[MapKey, Route]:
        """What the gateway serves, as the engine last confirmed it."""
        return self.adapter.confirmed

    # --- ChangeSink ---------------------------------------------------------------------------

    def changed(self, keys: Iterable[MapKey], *, at: float) -> None:
        for key in keys:
            self.queue.add(key, at)

    def synced(self) -> None:
        """The source has delivered its first full view: from now on absence means withdrawal."""
        self.is_synced = True
        self.synced_event.set()
        for key in self.all_keys():
            self.queue.add(key)

    # --- deciding ------------------------------------------------------------------------------

    def decide(self, key: MapKey) -> Outcome:
        item = self.stores.maps.get(key)
        # The InferenceService is the one spec.service names, in the map's namespace.
        service = item.spec.service if isinstance(item, TrafficMap) else key.name
        isvc = self.stores.isvcs.get(MapKey(key.namespace, service))
        if isinstance(item, InvalidObject):
            if item.deletion_timestamp is not None:
                # Invalid or not, a map being deleted leaves the gateway.
                return Withdraw(f"the TrafficMap is being deleted (since {item.deletion_timestamp})")
            held = gate.decide(item, isvc, self.options.gate)
            assert held is not None
            return Hold(held)
        reason = plan.withdrawal(item, isvc)
        if reason is not None:
            return Withdraw(reason)
        assert isinstance(item, TrafficMap)
        held = gate.decide(item, isvc, self.options.gate)
        if held is not None:
            return Hold(held)
        publication = plan.publication_for(item, isvc, self.options.host_template)
        held = self.adapter.check(publication)
        return Hold(held) if held is not None else Publish(publication)

    def _decide_guarded(self, key: MapKey) -> Outcome:
        """One map's decision; an unexpected error holds that map alone (InternalError)."""
        try:
            return self.decide(key)
        except Exception as exc:  # noqa: BLE001 - the boundary: one map must not stop the others
            return self._internal_error(key, "deciding", exc)

    def _internal_error(self, key: MapKey, doing: str, exc: Exception) -> Hold:
        if self._state(key).reason != Reason.INTERNAL_ERROR:
            log.exception("map internal error", extra={"map": str(key), "doing": doing})
        metrics.INTERNAL_ERRORS.inc()
        return Hold(Held(Reason.INTERNAL_ERROR, f"{doing} this map raised {type(exc).__name__}: {exc}"))

    # --- one pass ------------------------------------------------------------------------------

    async def sync_once(self, pending: Mapping[MapKey, float | None]) -> None:
        """Decide `pending`, hand every decision to the engine in one apply (it writes what
        changed), queue reports."""
        if not pending:
            return
        outcomes: dict[MapKey, Outcome] = {}
        for count, key in enumerate(pending, 1):
            outcomes[key] = self._decide_guarded(key)
            if count % DECIDE_SLICE == 0:
                await asyncio.sleep(0)  # a first pass of 10,000 maps lets the gateway's tasks and the server run
        # Every decision goes to the engine, which writes only what differs from what it
        # confirmed, and also what a client refused or two maps serve on one hostname.
        confirmed = self.adapter.confirmed
        decided: dict[MapKey, Publication | None] = {}
        for key, outcome in outcomes.items():
            if isinstance(outcome, Publish):
                decided[key] = outcome.publication
            elif isinstance(outcome, Withdraw):
                decided[key] = None
        before = {key: confirmed.get(key) for key in decided}
        # What a failed write leaves failed (or pending): the maps it would have changed, and the
        # maps that were failing already (a refusal is retried by writing the same route again).
        changes = frozenset(
            key for key, pub in decided.items()
            if (pub.route if pub is not None else None) != before[key] or self._state(key).state == "failed"
        )
        result = ApplyResult()
        failure: AdapterError | None = None
        if decided:
            started = self.clock()
            try:
                result = await self.adapter.apply(decided)
            except NotConnected as exc:
                failure = exc
                if self.gateway_waiting is None:
                    log.warning("gateway not connected, maps wait", extra={"adapter": self.adapter.name, "maps": len(changes), "error": str(exc)})
                self.gateway_waiting = str(exc)
            except AdapterError as exc:
                failure = exc
                log.warning("apply failed", extra={"adapter": self.adapter.name, "maps": len(changes), "error": str(exc)})
            if result.wrote or failure is not None:
                metrics.APPLY_DURATION.labels(adapter=self.adapter.name).observe(self.clock() - started)
            if failure is None:
                self._record_apply(before, result, pending)
        if failure is None:
            if changes or result.wrote or self.last_success is None:
                # A first pass with nothing to write stands on the read-back start() confirmed.
                self._gateway_confirmed()
            if result.wrote or not self._state_counts.get("pending"):
                self.gateway_waiting = None
        for key in result.released:
            self.queue.add(key)
        failed_keys = changes if failure is not None else frozenset()
        for key, outcome in outcomes.items():
            try:
                self._settle(key, outcome, failed_keys, failure, result)
            except Exception as exc:  # noqa: BLE001 - the boundary, as in deciding
                self._settle(key, self._internal_error(key, "reporting on", exc), failed_keys, failure, result)
        # Maps outside this pass that the apply held (a client's late refusal, a duplicate hostname).
        self._settle_rejected({key: held for key, held in result.rejected.items() if key not in outcomes})

    def _settle_rejected(self, rejected: Mapping[MapKey, Held]) -> None:
        result = ApplyResult(rejected=rejected)
        for key, held in rejected.items():
            self._settle(key, Hold(held), frozenset(), None, result)

    def _gateway_confirmed(self) -> None:
        """The gateway answered a write or a read-back: what readiness counts. A pass that had
        nothing to write confirms nothing about the gateway."""
        self.last_success = self.clock()
        metrics.LAST_SUCCESS.labels(adapter=self.adapter.name).set(time.time())

    def _record_apply(self, before: Mapping[MapKey, Route | None], result: ApplyResult, pending: Mapping[MapKey, float | None]) -> None:
        if result.reloads:
            # Reloads of an apply that had to isolate maps count as "rejected".
            outcome = "rejected" if result.rejected else "success"
            metrics.RELOADS.labels(adapter=self.adapter.name, result=outcome).inc(result.reloads)
        now = self.clock()
        confirmed = self.adapter.confirmed
        for key, old in before.items():
            if key in result.rejected:
                continue
            new = confirmed.get(key)
            if new == old:
                continue
            if self.split is not None:
                self.split.route_confirmed(key, new)
            metrics.PUBLICATIONS.labels(adapter=self.adapter.name, result="withdrawn" if new is None else "published").inc()
            metrics.map_weights(key, new)
            seen_at = pending.get(key)
            if seen_at is not None:
                metrics.EVENT_TO_APPLY.labels(adapter=self.adapter.name).observe(now - seen_at)

    def _settle(
        self, key: MapKey, outcome: Outcome, failed_keys: frozenset[MapKey], failure: AdapterError | None, result: ApplyResult
    ) -> None:
        """Record the map's state, back off what failed, and queue its report."""
        item = self.stores.maps.get(key)
        generation = item.metadata.generation if isinstance(item, TrafficMap) else item.generation if item else 0
        uid = _uid(item)
        failed: Held | None = None
        if key in failed_keys and isinstance(failure, NotConnected):
            # Nothing was written and nothing lost: not a failure, and the condition stays as it was.
            self.queue.add_after(key, min(PENDING_RETRY_CAP, self.backoff.delay(key)))
            self._set_state(key, MapState("pending", None, f"not written yet, retrying: {failure}"))
            return
        if key in failed_keys:
            failed = Held(Reason.APPLY_FAILED, f"gateway write failed, retrying: {failure}")
        elif key in result.rejected:
            rejected = result.rejected[key]
            if rejected.reason in (Reason.HOST_CONFLICT, Reason.INTERNAL_ERROR):
                # Not the gateway's doing: held until the owner lets go, or the map changes.
                outcome = Hold(rejected)
            else:
                failed = rejected
        if failed is not None:
            metrics.PUBLICATIONS.labels(adapter=self.adapter.name, result="failed").inc()
            self.queue.add_after(key, self.backoff.delay(key))
            self._set_state(key, MapState("failed", str(failed.reason), failed.message))
            report = status.Report(False, failed.reason, self._keeping(key, failed.message), generation, uid)
        else:
            self.backoff.forget(key)
            if isinstance(outcome, Publish):
                pub = outcome.publication
                self.provenance[key] = pub
                split_note = self.split.note(key) if self.split is not None else None
                message = _published_message(self.adapter.name, pub, result.notes.get(key), self._stale_probes(item), split_note)
                self._set_state(key, MapState("published"))
                report = status.Report(True, Reason.PUBLISHED, message, pub.generation, uid)
            elif isinstance(outcome, Hold):
                held = outcome.held
                if held.reason == Reason.VERIFICATION_FAILED and self._state(key).reason != held.reason:
                    metrics.VERIFICATION_FAILURES.inc()
                self._set_state(key, MapState("held", str(held.reason), held.message))
                report = status.Report(False, held.reason, self._keeping(key, held.message), generation, uid)
            else:
                self.provenance.pop(key, None)
                self._set_state(key, MapState("withdrawn", str(Reason.WITHDRAWN), outcome.message))
                report = status.Report(False, Reason.WITHDRAWN, f"withdrawn from the {self.adapter.name} gateway: {outcome.message}", generation, uid)
        if item is None:
            if failed is None:
                self._forget(key)
        elif self.status_sink is not None:
            self._queue_report(key, report)

    def _queue_report(self, key: MapKey, report: status.Report) -> None:
        """The latest verdict wins; a published one is written at once, any other once it has
        stood for status_delay (the gateway is not waiting: this is only what the status says)."""
        self.reports[key] = report
        if report.published:
            self._unpublished_since.pop(key, None)
            self.status_queue.add(key)
            return
        since = self._unpublished_since.setdefault(key, self.clock())
        wait = since + self.options.status_delay - self.clock()
        if wait > 0:
            self.status_queue.add_after(key, wait)
        else:
            self.status_queue.add(key)

    def _keeping(self, key: MapKey, message: str) -> str:
        if key not in self.adapter.confirmed:
            return f"{message}; nothing is published for this map"
        last = self.provenance.get(key)
        if last is None:
            return f"{message}; the gateway keeps the weights it served before this sidecar started"
        return f"{message}; the gateway keeps generation {last.generation}"

    def _forget(self, key: MapKey) -> None:
        """A map that is gone from the source and from the gateway leaves every record."""
        state = self.states.pop(key, None)
        if state is not None:
            self._count(state.state, -1)
        if self.reports.pop(key, None) is not None:
            self.status_queue.add(key)  # the sink forgets it
        self._unpublished_since.pop(key, None)
        self.provenance.pop(key, None)
        self.backoff.forget(key)
        self.status_backoff.forget(key)
        self._probe_notes.pop(key, None)
        metrics.forget_map(key)

    def _stale_probes(self, item: TrafficMap | InvalidObject | None) -> str | None:
        """The stale-probe note of a map's condition: it names the clusters and the limit, never an
        age, so a stalled prober changes the condition once, not on every pass."""
        if self.options.probe_max_age is None or not isinstance(item, TrafficMap):
            return None
        stale = gate.stalled_probes(item, self.options.probe_max_age, self.wall_clock())
        if stale is None:
            if self._probe_notes.pop(item.key, None) is not None:
                log.info("prober reporting again", extra={"map": str(item.key)})
            return None
        if self._probe_notes.get(item.key) != stale:
            log.warning("prober stalled", extra={"map": str(item.key), "detail": stale})
            self._probe_notes[item.key] = stale
        return stale

    def _state(self, key: MapKey) -> MapState:
        return self.states.get(key) or MapState()

    def _set_state(self, key: MapKey, new: MapState) -> None:
        old = self.states.get(key)
        if old is not None and old.state == new.state and old.reason == new.reason:
            self.states[key] = new
            return
        self.states[key] = new
        if old is not None:
            self._count(old.state, -1)
        self._count(new.state, +1)
        metrics.map_state(key, new.state, new.reason)
        if new.state == "held":
            log.warning("map held", extra={"map": str(key), "reason": new.reason, "detail": new.message})
        elif new.state == "failed":
            log.warning("map apply failed", extra={"map": str(key), "reason": new.reason, "detail": new.message})
        elif new.state == "published" and old is not None and old.state != "pending":
            log.info("map published", extra={"map": str(key)})
        elif new.state == "withdrawn":
            log.info("map withdrawn", extra={"map": str(key), "detail": new.message})

    def _count(self, state: str, delta: int) -> None:
        self._state_counts[state] = self._state_counts.get(state, 0) + delta
        metrics.MAPS.labels(state=state).set(self._state_counts[state])

    # --- status ---------------------------------------------------------------------------------

    async def write_reports(self, keys: Iterable[MapKey], *, at_once: bool = False) -> None:
        """Hand the sink the current verdict of each key (None: the map is gone); a verdict that
        has not stood for status_delay yet waits, unless `at_once`; what fails is retried with
        backoff. Only the leader writes."""
        if self.status_sink is None or not self.leading:
            return
        batch: dict[MapKey, status.Report | None] = {}
        now = self.clock()
        for key in keys:
            report = self.reports.get(key)
            if report is not None and not report.published and not at_once:
                wait = self._unpublished_since.get(key, now) + self.options.status_delay - now
                if wait > 0:
                    self.status_queue.add_after(key, wait)
                    continue
            batch[key] = report
        if not batch:
            return
        try:
            failed = await self.status_sink.write(batch)
        except status.SinkUnavailable as exc:
            # Nothing can be written: said once, the whole batch retried with one backoff. The
            # gateway path never waits for this.
            if str(exc) != self.status_problem:
                log.warning("status not written, retrying", extra={"error": str(exc)})
            self.status_problem = str(exc)
            delay = self.status_backoff.delay(_WHOLE_SINK)
            for key in batch:
                self.status_queue.add_after(key, delay)
            return
        if self.status_problem is not None:
            log.info("status writes resumed", extra={"was": self.status_problem})
            self.status_problem = None
        self.status_backoff.forget(_WHOLE_SINK)
        for key in batch:
            reason = failed.get(key)
            if reason is None:
                self.status_backoff.forget(key)
                continue
            metrics.STATUS_WRITES.labels(result="error").inc()
            log.warning("status write failed", extra={"map": str(key), "error": reason})
            self.status_queue.add_after(key, self.status_backoff.delay(key))

    # --- scheduling ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read back what the gateway serves: the starting state after a restart. The source may
        be listing meanwhile; each map read back is queued too, so one the source no longer has is
        withdrawn even when its first full view came first. A gateway with no client connected
        yet is waited for, retrying with backoff."""
        delay = self.options.backoff_base
        while True:
            try:
                served = await self.adapter.start()
                break
            except NotConnected as exc:
                if self.gateway_waiting is None:
                    log.warning("gateway not connected, waiting for it", extra={"adapter": self.adapter.name, "error": str(exc)})
                self.gateway_waiting = str(exc)
                await asyncio.sleep(delay)
                delay = min(PENDING_RETRY_CAP, delay * 2)
        self.gateway_waiting = None
        for key, route in served.items():
            metrics.map_weights(key, route)
            if self.split is not None:
                self.split.route_confirmed(key, route)
            self.queue.add(key)
        self.started = True

    def all_keys(self) -> set[MapKey]:
        return set(self.stores.maps.keys()) | set(self.published)

    async def run_applier(self) -> None:
        """Forever: take every dirty key, sync them in one pass. Nothing before the first sync.
        A resync that fell due is served here, between two passes, never beside one."""
        await self.synced_event.wait()
        await self.sync_once(self.queue.take_ready())
        # The first full view is long-lived: freezing it keeps every later full collection from
        # walking 10,000 maps (a pause of about 200 ms each) while events wait.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*self.gc_threshold)
        while True:
            await self.queue.wait()
            hold_off = self.adapter.hold_off()
            if hold_off > 0:
                await asyncio.sleep(hold_off)
            if self._reconcile_due:
                self._reconcile_due = False
                await self.reconcile()
            await self.sync_once(self.queue.take_ready())
            self._feed_resync_backlog()

    def _feed_resync_backlog(self) -> None:
        if self._resync_backlog and not len(self.queue):
            for key in self._resync_backlog[-DECIDE_SLICE:]:
                self.queue.add(key)
            del self._resync_backlog[-DECIDE_SLICE:]

    async def reconcile(self) -> None:
        """Read the gateway back and write back whatever drifted from what it confirmed; hold
        what a client refuses, and decide again what a read-back changed."""
        try:
            done = await self.adapter.reconcile()
        except AdapterError as exc:
            log.warning("resync read failed", extra={"adapter": self.adapter.name, "error": str(exc)})
            return
        self._gateway_confirmed()
        if done.repaired:
            log.warning("gateway drift repaired", extra={"adapter": self.adapter.name, "maps": len(done.repaired)})
        for key in done.released:
            self.queue.add(key)
        self._settle_rejected(done.refused)

    def lead(self) -> None:
        """This instance now writes status: what the server holds is read again (the last leader
        may have written after this instance last read), then every verdict is compared with it."""
        self.leading = True
        self.recheck_status()

    def recheck_status(self) -> None:
        """Compare every verdict with what the server holds now, and rewrite what differs (a
        report removed or edited by hand, a write of another leader)."""
        if self.status_sink is None:
            return
        self.status_sink.stale()
        for key in self.reports:
            self.status_queue.add(key)

    async def run_status_writer(self) -> None:
        """Forever: write the verdicts that fell due (the sink reads what it needs first; a sink
        that cannot be read is retried with backoff, never an end of the process)."""
        while True:
            keys = await self.status_queue.take()
            await self.write_reports(keys)

    async def run_resync(self) -> None:
        """Periodically ask the applier to repair drift and re-decide every map."""
        while True:
            await asyncio.sleep(self.options.resync)
            if self.is_synced:
                self.resync_now()

    def resync_now(self) -> None:
        """Ask the applier to repair drift and re-decide every map; the status is repaired as the
        gateway is (what the server holds is compared with every verdict)."""
        self._reconcile_due = True
        self._resync_backlog = sorted(self.all_keys(), reverse=True)
        self._feed_resync_backlog()
        if self.leading:
            self.recheck_status()

    # --- health -------------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.started

    def ready(self) -> tuple[bool, str]:
        """Ready once the gateway was read, the source gave its first full view and the gateway
        confirmed a pass. After that the API server plays no part (fail static: the gateway keeps
        serving what it holds); only a gateway that confirms no write or read-back for three
        resync intervals makes it unready (one that cannot be read meanwhile keeps serving)."""
        unready = self.adapter.unready()
        if not self.started:
            why = self.gateway_waiting or unready
            return False, f"gateway not read yet: {why}" if why else "gateway not read yet"
        if unready is not None:
            return False, unready
        if self.gateway_waiting is not None:
            return False, f"waiting for the gateway: {self.gateway_waiting}"
        if not self.is_synced:
            problem = self.source_problem()
            return False, f"waiting for the first sync: {problem}" if problem else "waiting for the first sync"
        if self.last_success is None:
            return False, "no successful sync yet"
        age = self.clock() - self.last_success
        if age > 3 * self.options.resync:
            return False, f"last successful sync {age:.0f}s ago"
        notes = []
        problem = self.source_problem()
        if problem:
            notes.append(f"the gateway keeps serving while the source fails: {problem}")
        if self.status_problem is not None and self.leading:
            notes.append(f"status is not written: {self.status_problem}")
        return True, f"ready; {'; '.join(notes)}" if notes else "ready"

    def debug_maps(self) -> list[dict[str, Any]]:
        maps = []
        fleet = getattr(self.adapter, "transport", None)
        served_by = fleet.served if isinstance(fleet, metrics.EnvoyFleet) else None
        for key in sorted(self.all_keys() | set(self.states)):
            state = self._state(key)
            route = self.published.get(key)
            provenance = self.provenance.get(key) if route is not None else None
            maps.append(
                {
                    "namespace": key.namespace,
                    "name": key.name,
                    "decision": state.state,
                    "reason": state.reason,
                    "message": state.message,
                    "publishedGeneration": provenance.generation if provenance else None,
                    "hostname": route.hostname if route else None,
                    "weights": {b.cluster: b.weight for b in route.backends} if route else None,
                    "probeAgeSeconds": _probe_ages(self.stores.maps.get(key), self.wall_clock()),
                }
            )
            if served_by is not None:
                maps[-1]["envoys"] = served_by(key)  # which version each connected Envoy serves
            maps[-1]["split"] = self.split.debug(key) if self.split is not None else split_check.unsupported(self.adapter.name)
        return maps

    def split_changed(self, key: MapKey) -> None:
        """A map's served split turned off or back: decide it again, so its condition says so."""
        self.queue.add(key)


def _published_message(adapter: str, pub: Publication, adapter_note: str | None, probe_note: str | None, split_note: str | None = None) -> str:
    weights = ", ".join(f"{b.cluster}={b.weight}" for b in pub.backends) or "no backends"
    parts = [f"the {adapter} gateway serves generation {pub.generation} for {pub.hostname}: {weights}"]
    if pub.all_zero and adapter_note is None:
        parts.append("every weight is 0, so the gateway answers 503")
    parts.extend(note for note in (adapter_note, probe_note, split_note) if note)
    return "; ".join(parts)


def _uid(item: TrafficMap | InvalidObject | None) -> str:
    if isinstance(item, TrafficMap):
        return item.metadata.uid
    metadata = item.raw.get("metadata") if item is not None else None
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    return uid if isinstance(uid, str) else ""


def _probe_ages(item: TrafficMap | InvalidObject | None, now: datetime) -> dict[str, int] | None:
    """Seconds since each cluster's last probe: the ticking number conditions must not carry."""
    if not isinstance(item, TrafficMap):
        return None
    ages = {}
    for entry in item.spec.entries:
        if entry.probe is not None and entry.probe.last_probe_time:
            try:
                probed = datetime.fromisoformat(entry.probe.last_probe_time.replace("Z", "+00:00"))
            except ValueError:
                continue
            ages[entry.cluster] = round((now - probed).total_seconds())
    return ages or None
