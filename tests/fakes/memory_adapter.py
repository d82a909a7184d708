"""A strict in-memory gateway for the loop's tests: a renderer and a transport run by the real
engine, so the loop's tests see every write, and impossible calls fail loudly.

Like external-dns's in-memory provider it refuses what a real gateway could not mean: a write's
`changes` must name exactly the maps whose part differs from what it serves, and two writes may
never overlap. Knobs: `fail_with` (raise on the next writes), `reject` (refuse single maps),
`cannot_express` (the renderer's problem for a map), `apply_delay`, `refused_later` (refusals
a client makes outside a write, handed out by the next `refusals()`), `held_back` (maps some
clients take and others refuse: written, and returned as held back with these words).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from adapters.base import AdapterError, TransportDefaults, WriteResult
from adapters.engine import Engine
from publisher.core.values import MapKey, Route


@dataclass
class MemoryGateway(TransportDefaults):
    held: dict[MapKey, Route] = field(default_factory=dict)
    applies: list[frozenset[MapKey]] = field(default_factory=list)
    reads: int = 0
    fail_with: list[AdapterError] = field(default_factory=list)
    reject: dict[MapKey, str] = field(default_factory=dict)
    cannot_express: dict[MapKey, str] = field(default_factory=dict)
    refused_later: dict[MapKey, str] = field(default_factory=dict)
    held_back: dict[MapKey, str] = field(default_factory=dict)
    apply_delay: float = 0.0
    closed: bool = False
    _in_flight: bool = False

    # Renderer
    def problem(self, key: MapKey, route: Route) -> str | None:
        return self.cannot_express.get(key)

    def render(self, key: MapKey, route: Route) -> Route:
        return route

    # Transport
    async def read(self) -> dict[MapKey, Route]:
        assert not self._in_flight, "a read overlapped a write"
        self.reads += 1
        return dict(self.held)

    async def write(self, parts: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]) -> WriteResult:
        assert not self._in_flight, "two writes overlapped"
        differing = {k for k in set(parts) | set(self.held) if parts.get(k) != self.held.get(k)}
        assert differing <= set(changes), f"changes {sorted(changes)} miss {sorted(differing - set(changes))}"
        self._in_flight = True
        try:
            if self.apply_delay:
                await asyncio.sleep(self.apply_delay)
            self.applies.append(frozenset(changes))
            if self.fail_with:
                raise self.fail_with.pop(0)
            rejected = {k: msg for k, msg in self.reject.items() if k in changes}
            for key, part in changes.items():
                if key in rejected:
                    continue
                if part is None:
                    self.held.pop(key, None)
                else:
                    self.held[key] = part
            return WriteResult(rejected=rejected, held_back={k: msg for k, msg in self.held_back.items() if k in changes and k not in rejected})
        finally:
            self._in_flight = False

    def refusals(self) -> dict[MapKey, str]:
        refused, self.refused_later = self.refused_later, {}
        return refused

    async def aclose(self) -> None:
        self.closed = True


def memory_engine(gateway: MemoryGateway | None = None, name: str = "memory") -> tuple[Engine[Route], MemoryGateway]:
    gateway = gateway if gateway is not None else MemoryGateway()
    return Engine(name, gateway, gateway), gateway
