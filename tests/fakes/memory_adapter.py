"""A strict in-memory adapter: the loop's tests see every apply, and impossible calls fail loudly.

Like external-dns's in-memory provider it refuses what a real gateway could not mean: `changed`
must name exactly the keys whose Publication differs from what it holds, and two applies may
never overlap. Knobs: `fail_with` (raise on the next applies), `reject` (refuse single maps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from adapters.base import AdapterError, ApplyResult
from publisher.model import Held, MapKey, Publication, Reason


@dataclass
class MemoryAdapter:
    name: str = "memory"
    held: dict[MapKey, Publication] = field(default_factory=dict)
    applies: list[frozenset[MapKey]] = field(default_factory=list)
    fail_with: list[AdapterError] = field(default_factory=list)
    reject: dict[MapKey, str] = field(default_factory=dict)
    cannot_express: dict[MapKey, str] = field(default_factory=dict)
    apply_delay: float = 0.0
    closed: bool = False
    _in_flight: bool = False

    def check(self, pub: Publication) -> Held | None:
        message = self.cannot_express.get(pub.key)
        return Held(Reason.INVALID_PLAN, message) if message else None

    async def current(self) -> dict[MapKey, Publication]:
        return dict(self.held)

    async def apply(self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]) -> ApplyResult:
        assert not self._in_flight, "two applies overlapped"
        differing = {k for k in set(desired) | set(self.held) if desired.get(k) != self.held.get(k)}
        unrejected = differing - set(self.reject)
        assert unrejected <= changed, f"changed {sorted(changed)} misses {sorted(unrejected - changed)}"
        self._in_flight = True
        try:
            if self.apply_delay:
                await asyncio.sleep(self.apply_delay)
            self.applies.append(changed)
            if self.fail_with:
                raise self.fail_with.pop(0)
            rejected = {k: Held(Reason.APPLY_FAILED, msg) for k, msg in self.reject.items() if k in changed}
            for key in changed - set(rejected):
                if key in desired:
                    self.held[key] = desired[key]
                else:
                    self.held.pop(key, None)
            return ApplyResult(rejected=rejected, wrote=bool(changed - set(rejected)))
        finally:
            self._in_flight = False

    def hold_off(self) -> float:
        return 0.0

    async def aclose(self) -> None:
        self.closed = True
