"""The status outbox: each map's latest verdict, on its way to the StatusSink.

A published verdict is written at once; any other once it has stood for status_delay (between
OME's two writes of a change a map is held for milliseconds, news to no one). Only the leader
writes; what fails is retried with backoff, and a slow API server never delays the gateway: the
applier only puts verdicts here, and `run` is a task of its own.

Owns the verdicts by map (`reports`), since when each has been other than published, the keys due a
write (`due`) and their backoff, whether this replica leads, and why no verdict can be written
(`problem`, for /readyz and the log).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from publisher import metrics, status
from publisher.core.values import MapKey
from publisher.loop.keys import KeyQueue
from publisher.loop.options import STATUS_CHUNK, LoopOptions
from publisher.retry import Backoff

log = logging.getLogger("publisher.loop")

# The backoff's key for a sink that cannot write at all (one backoff, not one per map).
WHOLE_SINK = MapKey("", "")


class StatusOutbox:
    """Verdicts by map, written by `run` (or `write`) into `sink`; None: no status is written.
    `run` awaits `gateway_turn` before each chunk of writes: the gateway's work goes first."""

    def __init__(
        self,
        sink: status.StatusSink | None,
        options: LoopOptions,
        clock: Callable[[], float],
        gateway_turn: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.sink = sink
        self._gateway_turn = gateway_turn
        self.clock = clock
        self._delay = options.status_delay
        self.due = KeyQueue(clock)
        self.backoff = Backoff(options.backoff_base, options.backoff_cap)
        self.verdicts: dict[MapKey, status.Verdict] = {}
        # Since when each map's verdict has been other than published, for status_delay.
        self._unpublished_since: dict[MapKey, float] = {}
        self._leading = sink is not None
        self.problem: str | None = None

    @property
    def leading(self) -> bool:
        """Whether this replica writes status (the Lease's holder, or the only replica)."""
        return self._leading

    def put(self, key: MapKey, verdict: status.Verdict, *, since: float | None = None) -> None:
        """The latest verdict wins; a published one is written at once, any other once it has
        stood for status_delay (the gateway is not waiting: this is only what the status says),
        counted from `since` when the loop knows the map was held before (default: now)."""
        if self.sink is None:
            return
        self.verdicts[key] = verdict
        if verdict.published:
            self._unpublished_since.pop(key, None)
            self.due.add(key)
            return
        since = self._unpublished_since.setdefault(key, self.clock() if since is None else since)
        wait = since + self._delay - self.clock()
        if wait > 0:
            self.due.add_after(key, wait)
        else:
            self.due.add(key)

    def forget(self, key: MapKey) -> None:
        """A map gone from the source and the gateway: the sink forgets it too."""
        if self.verdicts.pop(key, None) is not None:
            self.due.add(key)
        self._unpublished_since.pop(key, None)
        self.backoff.forget(key)

    async def write(self, keys: Iterable[MapKey], *, at_once: bool = False) -> None:
        """Hand the sink the current verdict of each key (None: the map is gone); a verdict that
        has not stood for status_delay yet waits, unless `at_once`; what fails is retried with
        backoff. Only the leader writes."""
        if self.sink is None or not self._leading:
            return
        batch: dict[MapKey, status.Verdict | None] = {}
        now = self.clock()
        for key in keys:
            verdict = self.verdicts.get(key)
            if verdict is not None and not verdict.published and not at_once:
                wait = self._unpublished_since.get(key, now) + self._delay - now
                if wait > 0:
                    self.due.add_after(key, wait)
                    continue
            batch[key] = verdict
        if not batch:
            return
        try:
            failed = await self.sink.write(batch)
        except status.SinkUnavailable as exc:
            # Nothing can be written: said once, the whole batch retried with one backoff. The
            # gateway path never waits for this.
            if str(exc) != self.problem:
                log.warning("status not written, retrying", extra={"error": str(exc)})
            self.problem = str(exc)
            delay = self.backoff.delay(WHOLE_SINK)
            for key in batch:
                self.due.add_after(key, delay)
            return
        if self.problem is not None:
            log.info("status writes resumed", extra={"was": self.problem})
            self.problem = None
        self.backoff.forget(WHOLE_SINK)
        for key in batch:
            reason = failed.get(key)
            if reason is None:
                self.backoff.forget(key)
                continue
            metrics.STATUS_WRITES.labels(result="error").inc()
            log.warning("status write failed", extra={"map": str(key), "error": reason})
            self.due.add_after(key, self.backoff.delay(key))

    async def write_all(self) -> None:
        """Every verdict now, delay or not (the end of a one-off pass)."""
        await self.write(list(self.verdicts), at_once=True)

    async def run(self) -> None:
        """Forever: write the verdicts that fell due (the sink reads what it needs first; a sink
        that cannot be read is retried with backoff, never an end of the process)."""
        while True:
            keys = list(await self.due.take())
            for start in range(0, len(keys), STATUS_CHUNK):
                if self._gateway_turn is not None:
                    await self._gateway_turn()
                await self.write(keys[start : start + STATUS_CHUNK])

    def lead(self) -> None:
        """This replica now writes status: what the server holds is read again (the last leader
        may have written after this replica last read), then every verdict is compared with it."""
        self._leading = True
        self.recheck()

    def follow(self) -> None:
        """Another replica writes status (or none does until the Lease is won): this one stops."""
        self._leading = False

    def compare(self, keys: Iterable[MapKey]) -> None:
        """Compare these maps' verdicts (those it has) with what the server holds now."""
        if self.sink is None:
            return
        for key in keys:
            if key in self.verdicts:
                self.due.add(key)

    def stale(self) -> None:
        """What the server holds may have changed behind the writer: the sink reads it again before
        its next write. A resync says this, then settles every map again, which compares each
        verdict (a report removed or edited by hand is rewritten then)."""
        if self.sink is not None:
            self.sink.stale()

    def recheck(self) -> None:
        """Compare every verdict with what the server holds now, and rewrite what differs (a
        report removed or edited by hand, a write of another leader)."""
        self.stale()
        self.compare(self.verdicts)

    def sink_failures(self) -> int:
        """Failed attempts in a row to write to a sink that could write nothing."""
        return self.backoff.failures(WHOLE_SINK)
