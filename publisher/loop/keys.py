"""The applier's work: dirty keys, deduplicated, with backoff (`KeyQueue`, which owns the ready and
the delayed keys), and a resync's backlog (`ResyncBacklog`, which owns the keys a resync has yet to
hand the queue and whether a read-back of the gateway is due).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import Callable, Iterable

from publisher.core.values import MapKey
from publisher.loop.options import DECIDE_SLICE


class KeyQueue:
    """Dirty keys, deduplicated. A key added again before it is taken is processed once; one added
    while its batch is being processed is processed once more afterwards. `add_after` parks a key
    until a delay passes (backoff), `cancel_after` drops what it was parked for. Remembers the
    earliest event time of each pending key."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ready: dict[MapKey, float | None] = {}
        self._delayed: list[tuple[float, int, MapKey]] = []
        self._sequence = 0
        # Per parked key: how many of its entries the heap holds, and the newest one cancelled
        # (that one and every older one are dropped when they fall due).
        self._parked: dict[MapKey, int] = {}
        self._cancelled: dict[MapKey, int] = {}
        self._wakeup = asyncio.Event()

    def add(self, key: MapKey, at: float | None = None) -> None:
        previous = self._ready.get(key)
        if key not in self._ready or (previous is None and at is not None):
            self._ready[key] = at
        self._wakeup.set()

    def add_after(self, key: MapKey, delay: float) -> None:
        self._sequence += 1
        heapq.heappush(self._delayed, (self._clock() + delay, self._sequence, key))
        self._parked[key] = self._parked.get(key, 0) + 1
        self._wakeup.set()

    def cancel_after(self, key: MapKey) -> None:
        """`key` need not come back for what it was parked for: its parked entries are dropped."""
        if key in self._parked:
            self._cancelled[key] = self._sequence

    def __len__(self) -> int:
        return len(self._ready)

    def _promote_due(self) -> float | None:
        """Move due delayed keys to ready; return seconds until the next one is due."""
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            _, sequence, key = heapq.heappop(self._delayed)
            cancelled = sequence <= self._cancelled.get(key, 0)
            left = self._parked[key] - 1
            if left:
                self._parked[key] = left
            else:
                del self._parked[key]
                self._cancelled.pop(key, None)
            if not cancelled:
                self._ready.setdefault(key, None)
        return self._delayed[0][0] - now if self._delayed else None

    def take_ready(self) -> dict[MapKey, float | None]:
        self._promote_due()
        ready, self._ready = self._ready, {}
        return ready

    async def wait(self, timeout: float | None = None) -> bool:
        """Until at least one key is ready (True), or `timeout` seconds passed (False)."""
        try:
            async with asyncio.timeout(timeout):
                await self._until_ready()
        except TimeoutError:
            return False
        return True

    async def _until_ready(self) -> None:
        while True:
            wait = self._promote_due()
            if self._ready:
                return
            self._wakeup.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # comes as the event is set, and the task then waited forever (a test's shutdown hung).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wakeup.wait()

    async def take(self) -> dict[MapKey, float | None]:
        """Every ready key with its earliest event time; waits until there is at least one."""
        await self.wait()
        return self.take_ready()


class ResyncBacklog:
    """A resync's work for the applier: read the gateway back (repair drift), and decide every map
    again, its keys fed to `queue` a slice at a time when it has nothing else, so a resync of 10,000
    maps never holds a fresh event back or the event loop up. With `pages`, the read-back goes
    with the slices too: each slice fed is a page to read back before it is decided (the last one
    also reads what the gateway serves besides), so a read of 10,000 maps never holds the applier
    either."""

    def __init__(self, queue: KeyQueue, *, pages: bool = False) -> None:
        self._queue = queue
        self._pages = pages
        self._keys: list[MapKey] = []
        self._reconcile_due = False
        # The slice fed last, not read back yet, and whether it is the resync's last.
        self._page: tuple[list[MapKey], bool] | None = None

    def request(self, keys: Iterable[MapKey]) -> None:
        """A resync fell due: a read-back, then `keys` decided again."""
        self._keys = sorted(keys, reverse=True)
        if self._pages:
            self._page = None
            if not self._keys:
                self._page = ([], True)  # nothing to decide: what the gateway serves besides
        else:
            self._reconcile_due = True
        self.feed()

    def take_reconcile(self) -> bool:
        """Whether a read-back of the whole gateway is due; it is not any more."""
        due, self._reconcile_due = self._reconcile_due, False
        return due

    def take_page(self) -> tuple[list[MapKey], bool] | None:
        """The page to read back now, with whether it is the resync's last; None: none is due."""
        page, self._page = self._page, None
        return page

    def feed(self) -> None:
        """The next slice of keys, when the queue holds none."""
        if self._keys and not len(self._queue):
            page = self._keys[-DECIDE_SLICE:]
            del self._keys[-DECIDE_SLICE:]
            for key in page:
                self._queue.add(key)
            if self._pages:
                self._page = (page, not self._keys)

    def __len__(self) -> int:
        """Keys not yet fed to the queue."""
        return len(self._keys)
