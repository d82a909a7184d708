"""The loop's calls to the gateway engine, timed and logged, and what they say about the gateway.

The applier is the engine's one caller, so a read-back never runs beside a write. Owns why the
gateway cannot be written yet (`waiting`: no client connected; None once it can) and when it last
confirmed a write or a read-back (`last_success`): what /readyz and the last-success metric say.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from adapters.base import Adapter, AdapterError, ApplyResult, NotConnected, Reconciled
from publisher import metrics
from publisher.core.values import MapKey, Route
from publisher.loop.decide import Batch
from publisher.loop.options import PENDING_RETRY_CAP, LoopOptions

log = logging.getLogger("publisher.loop")


@dataclass(frozen=True)
class Applied:
    """One apply: what the engine did, or why it could not (then nothing was confirmed)."""

    result: ApplyResult = field(default_factory=ApplyResult)
    failure: AdapterError | None = None


class Gateway:
    """The engine as the loop sees it: read back, written, repaired."""

    def __init__(self, adapter: Adapter, options: LoopOptions, clock: Callable[[], float]) -> None:
        self.adapter = adapter
        self.clock = clock
        self._first_retry = options.backoff_base
        self.waiting: str | None = None
        self.last_success: float | None = None

    async def read_back(self) -> Mapping[MapKey, Route]:
        """What the gateway serves: the starting state after a restart. A gateway with no client
        connected yet is waited for, retrying with backoff."""
        delay = self._first_retry
        while True:
            try:
                served = await self.adapter.start()
                break
            except NotConnected as exc:
                if self.waiting is None:
                    log.warning("gateway not connected, waiting for it", extra={"adapter": self.adapter.name, "error": str(exc)})
                self.waiting = str(exc)
                await asyncio.sleep(delay)
                delay = min(PENDING_RETRY_CAP, delay * 2)
        self.waiting = None
        return served

    async def apply(self, batch: Batch) -> Applied:
        """Hand the engine every decision of a pass in one apply (none when there is none)."""
        if not batch.decided:
            return Applied()
        started = self.clock()
        result = ApplyResult()
        failure: AdapterError | None = None
        try:
            result = await self.adapter.apply(batch.decided)
        except NotConnected as exc:
            failure = exc
            if self.waiting is None:
                log.warning("gateway not connected, maps wait", extra={"adapter": self.adapter.name, "maps": len(batch.changes), "error": str(exc)})
            self.waiting = str(exc)
        except AdapterError as exc:
            failure = exc
            log.warning("apply failed", extra={"adapter": self.adapter.name, "maps": len(batch.changes), "error": str(exc)})
        if result.wrote or failure is not None:
            metrics.APPLY_DURATION.labels(adapter=self.adapter.name).observe(self.clock() - started)
        return Applied(result, failure)

    def passed(self, batch: Batch, result: ApplyResult, *, maps_pending: int) -> None:
        """A pass whose apply did not fail: the gateway answered, unless the pass had nothing to
        write (a first pass with nothing to write stands on the read-back start() confirmed); it
        can be written once it took a write or no map waits for one."""
        if batch.changes or result.wrote or self.last_success is None:
            self.confirmed()
        if result.wrote or not maps_pending:
            self.waiting = None

    def confirmed(self) -> None:
        """The gateway answered a write or a read-back: what readiness counts. A pass that had
        nothing to write confirms nothing about the gateway."""
        self.last_success = self.clock()
        metrics.LAST_SUCCESS.labels(adapter=self.adapter.name).set(time.time())

    async def reconcile(self, page: tuple[Collection[MapKey], bool] | None = None) -> Reconciled | None:
        """Read the gateway back (a `page` of maps with whether it is a resync's last, or all of
        it) and write back whatever drifted from what it confirmed; None when it could not be read."""
        try:
            done = await (self.adapter.reconcile() if page is None else self.adapter.reconcile_page(page[0], last=page[1]))
        except AdapterError as exc:
            log.warning("resync read failed", extra={"adapter": self.adapter.name, "error": str(exc)})
            return None
        self.confirmed()
        if done.repaired:
            log.warning("gateway drift repaired", extra={"adapter": self.adapter.name, "maps": len(done.repaired)})
        return done
