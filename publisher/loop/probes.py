"""The stale-probe note of a map's condition.

Owns the note last logged per map, so a stalled prober is logged once, not on every pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from publisher.core import gate
from publisher.core.model import InvalidObject, TrafficMap
from publisher.core.values import MapKey

log = logging.getLogger("publisher.loop")


class ProbeNotes:
    """Stale probe results, looked for when `max_age` is set (None: they are not)."""

    def __init__(self, max_age: float | None, wall_clock: Callable[[], datetime]) -> None:
        self._max_age = max_age
        self._wall_clock = wall_clock
        self._notes: dict[MapKey, str] = {}

    def note(self, item: TrafficMap | InvalidObject | None) -> str | None:
        """The stale-probe note of a map's condition: it names the clusters and the limit, never an
        age, so a stalled prober changes the condition once, not on every pass."""
        if self._max_age is None or not isinstance(item, TrafficMap):
            return None
        stale = gate.stalled_probes(item, self._max_age, self._wall_clock())
        if stale is None:
            if self._notes.pop(item.key, None) is not None:
                log.info("prober reporting again", extra={"map": str(item.key)})
            return None
        if self._notes.get(item.key) != stale:
            log.warning("prober stalled", extra={"map": str(item.key), "detail": stale})
            self._notes[item.key] = stale
        return stale

    def forget(self, key: MapKey) -> None:
        self._notes.pop(key, None)
