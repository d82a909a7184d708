"""Lua mode's request counts for the served-split check: NGINX's pick-time counters (ome_counts.lua),
read through the transport's control requests, as deltas since the last read."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from adapters.base import RequestCounts, Unavailable
from publisher.core.values import MapKey

__all__ = ["CountedTransport", "LuaRequestCounts"]

# The name the counter's log lines had before it moved out of adapters/nginx_lua.py.
log = logging.getLogger("adapters.nginx_lua")


class EvictionStats(Protocol):
    counters_evicted: int


class CountedTransport(Protocol):
    """What the counter reads of Lua mode's transport (adapters.nginx.lua.LuaTransport)."""

    @property
    def stats(self) -> EvictionStats: ...

    def confirmed_maps(self) -> list[MapKey]:
        """The maps NGINX confirmed, now."""
        ...

    def confirmed_clusters(self, key: MapKey) -> list[str] | None:
        """A confirmed map's backend clusters now; None once it is gone."""
        ...

    async def exchange(self, method: str, path: str, body: str | None = None) -> tuple[int, dict[str, Any], str]:
        """One control request: its status, the answer's first line and the rest."""
        ...


class LuaRequestCounts:
    """Lua mode's RequestCounter (adapters.base): NGINX's pick-time counters of the confirmed maps'
    backends, read a page at a time, as deltas since the last read. The counters only grow
    within one boot: a new boot id starts the instance's count over, and a counter evicted from a
    full dict (another generation, or a count that went down) its map's, rather than be misread.
    Evictions are counted (LuaStats.counters_evicted) and logged once: the dict is too small for
    the maps it counts."""

    # Counters a request (a map's backends stay in one page, so a page may hold a few more), and
    # the pause between two: a page holds one NGINX worker (8,000 held it 25 ms, 2,000 about 6 ms),
    # and a weight change that reaches that worker meanwhile waits; a read of 10,000 maps is
    # spread over about a second instead.
    page_backends = 500
    page_pause = 0.01

    def __init__(self, transport: CountedTransport, *, instance: str) -> None:
        self._transport = transport
        self.instance = instance
        self._enabled = False
        self._boot: str | None = None
        # Each counter's count and generation at the last read (two dicts of ints: no object per
        # counter for the collector to walk); generation None from an ome_counts.lua that gives
        # none (older than generations), 0 for no counter.
        self._seen: dict[str, int] = {}
        self._generations: dict[str, int | None] = {}
        self._evictions_logged = False
        self.clock: Callable[[], float] = time.monotonic

    def enable(self, interval: float) -> None:
        self._enabled = True

    def _pages(self, keys: list[MapKey]) -> Iterator[tuple[list[tuple[MapKey, str]], list[str]]]:
        """Each page's (map, cluster) pairs and counter names, made only when it is asked: made for
        every map at once, 40,000 pairs held the event loop 15-85 ms at the start of each read
        (the collector's passes over them included), and every weight change waited."""
        page: list[tuple[MapKey, str]] = []
        for key in keys:
            # The transport's maps as they are now (a restore replaces the dict): a map deleted
            # since the read began is not asked.
            clusters = self._transport.confirmed_clusters(key)
            if clusters is None:
                continue
            page.extend((key, cluster) for cluster in clusters)
            if len(page) >= self.page_backends:
                yield page, [f"{k.namespace}/{k.name}|{cluster}" for k, cluster in page]
                page = []
        if page:
            yield page, [f"{k.namespace}/{k.name}|{cluster}" for k, cluster in page]

    async def collect(self) -> list[RequestCounts]:
        if not self._enabled:
            return []
        transport = self._transport
        at = self.clock()  # before any page: every counter read is at least this late
        seen: dict[str, int] = {}
        seen_generations: dict[str, int | None] = {}
        deltas: dict[MapKey, dict[str, int]] = {}
        boots: set[str] = set()
        went_down: set[MapKey] = set()
        evicted = 0
        # Each page is made, asked and folded before the next, yielding between.
        for page, names in self._pages(transport.confirmed_maps()):
            # Beside the table's writes, not under their lock: a read of counters changes nothing
            # the transport keeps, and must never hold a weight change back.
            status, answer, _ = await transport.exchange("POST", "/counts", "\n".join(names) + "\n")
            if status != 200:
                raise Unavailable(f"nginx control listener: POST /counts: {answer.get('error', f'HTTP {status}')}")
            counts = answer.get("counts")
            if not isinstance(counts, list) or len(counts) != len(page) or not all(isinstance(n, int) for n in counts):
                raise Unavailable("nginx control listener: POST /counts: answered counts that do not match the keys asked")
            generations = answer.get("generations", [None] * len(page))
            if not isinstance(generations, list) or len(generations) != len(page) or not all(isinstance(g, int | None) for g in generations):
                raise Unavailable("nginx control listener: POST /counts: answered generations that do not match the keys asked")
            boots.add(str(answer.get("boot")))
            for (key, cluster), name, value, generation in zip(page, names, counts, generations, strict=True):
                seen[name], seen_generations[name] = value, generation
                last_value = self._seen.get(name)
                if last_value is None:
                    continue
                last_generation = self._generations.get(name)
                if value < last_value or (last_generation and generation != last_generation):
                    went_down.add(key)
                    evicted += 1
                elif value > last_value:
                    deltas.setdefault(key, {})[cluster] = value - last_value
            await asyncio.sleep(self.page_pause)
        restarted = len(boots) > 1 or (bool(boots) and boots != {self._boot})
        if boots:
            self._boot = next(iter(boots)) if len(boots) == 1 else None
        self._seen, self._generations = seen, seen_generations
        if restarted:
            return [RequestCounts(self.instance, restarted=True, at=at)]
        if evicted:
            self._note_evictions(evicted)
        for key in went_down:
            deltas.pop(key, None)  # its other counters' deltas are of a count that starts over
        return [RequestCounts(self.instance, deltas, recounted=frozenset(went_down), at=at)]

    def _note_evictions(self, evicted: int) -> None:
        self._transport.stats.counters_evicted += evicted
        if not self._evictions_logged:
            self._evictions_logged = True
            # Once: every later read of a dict this small evicts again.
            log.warning("nginx request counters evicted: raise nginx-config --counts-dict-size", extra={"evicted": evicted, "dict": "ome_counts"})
