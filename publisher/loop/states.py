"""Each map's state as the loop last settled it, and how many maps are in each state.

Pure: no I/O, no metrics, no logs. Owns `MapStates`, the state by map and the count by state, kept
in step. The settler (settle.py) is its one writer; the metrics and log lines of a change are its.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from publisher.core.values import MapKey


@dataclass
class MapState:
    """What the loop last decided for a map, for /debug/maps, metrics and logs."""

    state: str = "pending"  # published | held | withdrawn | pending | failed
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class StateChange:
    """A map moved to another state or reason (`old` None: its first state)."""

    old: MapState | None
    new: MapState


class MapStates(Mapping[MapKey, MapState]):
    """The state by map, read as a mapping; `set` and `forget` keep the count by state in step."""

    def __init__(self) -> None:
        self._states: dict[MapKey, MapState] = {}
        self._counts: dict[str, int] = {}

    def __getitem__(self, key: MapKey) -> MapState:
        return self._states[key]

    def __iter__(self) -> Iterator[MapKey]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def state(self, key: MapKey) -> MapState:
        """The map's state; "pending" for one never settled."""
        return self._states.get(key) or MapState()

    def count(self, state: str) -> int:
        return self._counts.get(state, 0)

    def set(self, key: MapKey, new: MapState) -> StateChange | None:
        """Record the map's state; the change, or None when only the message is new."""
        old = self._states.get(key)
        self._states[key] = new
        if old is not None and old.state == new.state and old.reason == new.reason:
            return None
        if old is not None:
            self._counts[old.state] -= 1
        self._counts[new.state] = self._counts.get(new.state, 0) + 1
        return StateChange(old, new)

    def forget(self, key: MapKey) -> MapState | None:
        """Drop the map; the state it had, if any."""
        old = self._states.pop(key, None)
        if old is not None:
            self._counts[old.state] -= 1
        return old
