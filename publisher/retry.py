"""The sidecar's retry policies, one object per kind of retry, on tenacity's wait strategies.

`ReconnectBackoff`: the source's list and watch reconnects (publisher.source). `Backoff`: the
loop's per-map retries of gateway writes and status writes (publisher.loop). tenacity does the
arithmetic (exponential growth, cap, jitter); what to retry and when a streak is over stays
with the caller, whose loops retry several kinds of failure differently (a refusal waits 30 s,
a watch that stayed up a minute starts the backoff over).
"""

from __future__ import annotations

import tenacity

from publisher.core.values import MapKey

__all__ = ["Backoff", "ReconnectBackoff"]


def _attempt(number: int) -> tenacity.RetryCallState:
    """What a wait strategy reads: the number of the attempt that just failed (1: the first)."""
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = number
    return state


class ReconnectBackoff:
    """Capped exponential backoff with jitter, forgotten after a healthy connection.

    `failed()` gives the next delay: initial, 2x, 4x, ... up to the cap, each scaled by a random
    factor in [0.5, 1] (half of it fixed, half uniformly random) so replicas that lost the API
    server together do not return in step. `connected_for(seconds)` forgets the failures once a
    connection has lasted `reset_after`.
    """

    def __init__(self, initial: float, cap: float, reset_after: float) -> None:
        half = {"multiplier": initial / 2, "max": cap / 2}
        self._wait = tenacity.wait_exponential(**half) + tenacity.wait_random_exponential(**half)
        self._reset_after = reset_after
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        return float(self._wait(_attempt(self.failures)))

    def connected_for(self, seconds: float) -> None:
        if seconds >= self._reset_after:
            self.failures = 0


class Backoff:
    """Per-key exponential backoff: base, 2x base, ... up to cap; `forget` on success."""

    def __init__(self, base: float = 0.5, cap: float = 60.0) -> None:
        self._wait = tenacity.wait_exponential(multiplier=base, max=cap)
        self._failures: dict[MapKey, int] = {}

    def delay(self, key: MapKey) -> float:
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        return float(self._wait(_attempt(failures)))

    def forget(self, key: MapKey) -> None:
        self._failures.pop(key, None)

    def failures(self, key: MapKey) -> int:
        return self._failures.get(key, 0)
