"""Settling a pass: each map's outcome and the engine's result become the map's state, its verdict
(put in the status outbox), its retry and the metrics and log lines that count them.

Owns each map's state and the counts by state (`states`), which Publication each served route came
from (`provenance`), the per-map backoff of gateway writes, the stale-probe notes, and since when
each published map waits for OME's second write of a change. Re-queues on the applier's KeyQueue
(the loop's) what failed, what the engine released and what waits for that write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime

from adapters.base import Adapter, ApplyResult, NotConnected
from publisher import metrics, status
from publisher.core.model import InvalidObject, TrafficMap
from publisher.core.values import Held, MapKey, Publication, Reason, Route
from publisher.core.plan import Hold, Outcome, Publish
from publisher.loop.decide import Batch
from publisher.loop.gateway import Applied
from publisher.loop.keys import KeyQueue
from publisher.loop.options import DECIDE_SLICE, PENDING_RETRY_CAP, LoopOptions
from publisher.loop.outbox import StatusOutbox
from publisher.loop.probes import ProbeNotes
from publisher.loop.states import MapState, MapStates
from publisher.retry import Backoff
from publisher.source.store import Stores
from publisher.split.check import SplitVerifier

log = logging.getLogger("publisher.loop")


class Settler:
    """Records what each map's outcome came to; `split` (the served-split check, where it is on)
    is passed per call, as the loop holds it."""

    def __init__(
        self,
        stores: Stores,
        adapter: Adapter,
        options: LoopOptions,
        queue: KeyQueue,
        outbox: StatusOutbox,
        clock: Callable[[], float],
        wall_clock: Callable[[], datetime],
    ) -> None:
        self._stores = stores
        self._adapter = adapter
        self._queue = queue
        self._outbox = outbox
        self._clock = clock
        self._delay = options.status_delay
        self.states = MapStates()
        self.provenance: dict[MapKey, Publication] = {}
        # Published maps decided RoutableOutdated but not settled so (published still), since
        # when: OME's first write of a change is in, its second (Routable for the new entries)
        # due milliseconds later.
        self._waiting_since: dict[MapKey, float] = {}
        self.backoff = Backoff(options.backoff_base, options.backoff_cap)
        self.probes = ProbeNotes(options.probe_max_age, wall_clock)

    def failing(self, key: MapKey) -> bool:
        """The map's last gateway write failed."""
        return self.states.state(key).state == "failed"

    async def record(self, before: Mapping[MapKey, Route | None], result: ApplyResult, pending: Mapping[MapKey, float | None], split: SplitVerifier | None) -> None:
        """Count what an apply that did not fail confirmed: reloads, publications, weights, and the
        time from each map's event to its write. Gives the event loop back every DECIDE_SLICE
        maps (the first pass's 10,000 took 70 ms in one turn); only the applier settles."""
        adapter = self._adapter.name
        if result.reloads:
            # Reloads of an apply that had to isolate maps count as "rejected".
            outcome = "rejected" if result.rejected else "success"
            metrics.RELOADS.labels(adapter=adapter, result=outcome).inc(result.reloads)
        now = self._clock()
        confirmed = self._adapter.confirmed
        for count, (key, old) in enumerate(before.items(), 1):
            if count % DECIDE_SLICE == 0:
                await asyncio.sleep(0)
            new = confirmed.get(key)
            if new == old:
                continue
            # What the gateway serves now, even for a map some client refused (held back on it
            # alone while the others serve it): the split check and the weights follow it.
            if split is not None:
                split.route_confirmed(key, new)
            metrics.map_weights(key, new)
            if key in result.rejected:
                continue
            metrics.PUBLICATIONS.labels(adapter=adapter, result="withdrawn" if new is None else "published").inc()
            seen_at = pending.get(key)
            if seen_at is not None:
                metrics.EVENT_TO_APPLY.labels(adapter=adapter).observe(now - seen_at)

    async def settle_pass(self, outcomes: Mapping[MapKey, Outcome], batch: Batch, applied: Applied, split: SplitVerifier | None) -> None:
        """Settle every map of a pass, and the maps outside it that the apply held (a client's late
        refusal, a duplicate hostname); queue again what the apply released. Gives the event loop
        back every DECIDE_SLICE maps (the first pass's 10,000 took 85 ms in one turn)."""
        result = applied.result
        for key in result.released:
            self._queue.add(key)
        failed_keys = batch.changes if applied.failure is not None else frozenset()
        for count, (key, outcome) in enumerate(outcomes.items(), 1):
            if count % DECIDE_SLICE == 0:
                await asyncio.sleep(0)
            try:
                self._settle(key, outcome, failed_keys, applied, split)
            except Exception as exc:  # noqa: BLE001 - the boundary, as in deciding
                self._settle(key, self.internal_error(key, "reporting on", exc), failed_keys, applied, split)
        self.settle_rejected({key: held for key, held in result.rejected.items() if key not in outcomes}, split)

    def settle_rejected(self, rejected: Mapping[MapKey, Held], split: SplitVerifier | None) -> None:
        applied = Applied(ApplyResult(rejected=rejected))
        for key, held in rejected.items():
            self._settle(key, Hold(held), frozenset(), applied, split)

    def internal_error(self, key: MapKey, doing: str, exc: Exception) -> Hold:
        """What an unexpected error while `doing` one map makes of it: held (InternalError), logged
        once while it lasts."""
        if self.states.state(key).reason != Reason.INTERNAL_ERROR:
            log.exception("map internal error", extra={"map": str(key), "doing": doing})
        metrics.INTERNAL_ERRORS.inc()
        return Hold(Held(Reason.INTERNAL_ERROR, f"{doing} this map raised {type(exc).__name__}: {exc}"))

    def forget(self, key: MapKey) -> None:
        """A map that is gone from the source and from the gateway leaves every record."""
        state = self.states.forget(key)
        if state is not None:
            metrics.MAPS.labels(state=state.state).set(self.states.count(state.state))
        self._outbox.forget(key)
        self.provenance.pop(key, None)
        if self._waiting_since.pop(key, None) is not None:
            self._queue.cancel_after(key)
        self.backoff.forget(key)
        self.probes.forget(key)
        metrics.forget_map(key)

    def _settle(self, key: MapKey, outcome: Outcome, failed_keys: frozenset[MapKey], applied: Applied, split: SplitVerifier | None) -> None:
        """Record the map's state, back off what failed, and queue its report."""
        failure, result = applied.failure, applied.result
        waits, held_since = self._between_writes(key, outcome, result)
        if waits:
            return
        adapter = self._adapter.name
        item = self._stores.maps.get(key)
        generation = item.metadata.generation if isinstance(item, TrafficMap) else item.generation if item else 0
        uid = object_uid(item)
        failed: Held | None = None
        if key in failed_keys and isinstance(failure, NotConnected):
            # Nothing was written and nothing lost: not a failure, and the condition stays as it was.
            self._queue.add_after(key, min(PENDING_RETRY_CAP, self.backoff.delay(key)))
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
            metrics.PUBLICATIONS.labels(adapter=adapter, result="failed").inc()
            self._queue.add_after(key, self.backoff.delay(key))
            self._set_state(key, MapState("failed", str(failed.reason), failed.message))
            verdict = status.Verdict(False, failed.reason, self._keeping(key, failed.message), generation, uid)
        else:
            self.backoff.forget(key)
            if isinstance(outcome, Publish):
                pub = outcome.publication
                self.provenance[key] = pub
                split_note = split.note(key) if split is not None else None
                message = published_message(adapter, pub, result.notes.get(key), self.probes.note(item), split_note)
                self._set_state(key, MapState("published"))
                verdict = status.Verdict(True, Reason.PUBLISHED, message, pub.generation, uid)
            elif isinstance(outcome, Hold):
                held = outcome.held
                if held.reason == Reason.VERIFICATION_FAILED and self.states.state(key).reason != held.reason:
                    metrics.VERIFICATION_FAILURES.inc()
                self._set_state(key, MapState("held", str(held.reason), held.message))
                verdict = status.Verdict(False, held.reason, self._keeping(key, held.message), generation, uid)
            else:
                self.provenance.pop(key, None)
                self._set_state(key, MapState("withdrawn", str(Reason.WITHDRAWN), outcome.message))
                verdict = status.Verdict(False, Reason.WITHDRAWN, f"withdrawn from the {adapter} gateway: {outcome.message}", generation, uid)
        if item is None:
            if failed is None:
                self.forget(key)
        else:
            self._outbox.put(key, verdict, since=held_since)

    def _between_writes(self, key: MapKey, outcome: Outcome, result: ApplyResult) -> tuple[bool, float | None]:
        """Whether the map waits for OME's second write of a change, and since when a hold that
        stopped waiting has stood. A published map held RoutableOutdated (the entries of a new
        generation are in, Routable for them milliseconds later) stays published, as the gateway
        serves it still: no state, verdict, series or log line per change. It is looked at again
        once the hold has stood status_delay, and settled as held then."""
        since = self._waiting_since.pop(key, None)
        if not (
            isinstance(outcome, Hold)
            and outcome.held.reason == Reason.ROUTABLE_OUTDATED
            and key not in result.rejected
            and self.states.state(key).state == "published"
        ):
            if since is not None:
                self._queue.cancel_after(key)
            return False, None
        now = self._clock()
        if since is None:
            if self._delay <= 0:
                return False, None
            self._queue.add_after(key, self._delay)
            since = now
        if now - since >= self._delay:
            self._queue.cancel_after(key)  # when an event, not the park, brought it here
            return False, since
        self._waiting_since[key] = since
        return True, None

    def _keeping(self, key: MapKey, message: str) -> str:
        if key not in self._adapter.confirmed:
            return f"{message}; nothing is published for this map"
        last = self.provenance.get(key)
        if last is None:
            return f"{message}; the gateway keeps the weights it served before this sidecar started"
        # Confirmed past the last publication: held back on the clients that refused it alone.
        where = "where refused, " if self._adapter.confirmed[key] != last.route else ""
        return f"{message}; {where}the gateway keeps generation {last.generation}"

    def _set_state(self, key: MapKey, new: MapState) -> None:
        change = self.states.set(key, new)
        if change is None:
            return
        old = change.old
        if old is not None:
            metrics.MAPS.labels(state=old.state).set(self.states.count(old.state))
        metrics.MAPS.labels(state=new.state).set(self.states.count(new.state))
        metrics.map_state(key, new.state, new.reason)
        if new.state == "held":
            log.warning("map held", extra={"map": str(key), "reason": new.reason, "detail": new.message})
        elif new.state == "failed":
            log.warning("map apply failed", extra={"map": str(key), "reason": new.reason, "detail": new.message})
        elif new.state == "published" and old is not None and old.state != "pending":
            log.info("map published", extra={"map": str(key)})
        elif new.state == "withdrawn":
            log.info("map withdrawn", extra={"map": str(key), "detail": new.message})


def published_message(adapter: str, pub: Publication, adapter_note: str | None, probe_note: str | None, split_note: str | None = None) -> str:
    """A published map's condition message: what the gateway serves, and what is worth a note."""
    weights = ", ".join(f"{b.cluster}={b.weight}" for b in pub.backends) or "no backends"
    parts = [f"the {adapter} gateway serves generation {pub.generation} for {pub.hostname}: {weights}"]
    if pub.all_zero and adapter_note is None:
        parts.append("every weight is 0, so the gateway answers 503")
    parts.extend(note for note in (adapter_note, probe_note, split_note) if note)
    return "; ".join(parts)


def object_uid(item: TrafficMap | InvalidObject | None) -> str:
    """The object's metadata.uid, valid or not ("" when it has none)."""
    if isinstance(item, TrafficMap):
        return item.metadata.uid
    metadata = item.raw.get("metadata") if item is not None else None
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    return uid if isinstance(uid, str) else ""
