"""NGINX Lua mode's cache of resolved endpoint names (pure): which names are due a lookup, what a
round of lookups leaves known, and which maps a failed lookup rejects. LuaTransport owns one and
does the lookups.

A name keeps its last addresses until a lookup succeeds (fail static); an IP literal is its own
address and is never looked up.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping, Sequence

from adapters.nginx.lua_render import LuaPart
from publisher.core.values import MapKey

__all__ = ["RESOLVE_INTERVAL", "NameCache", "ip_literal", "rejected_maps"]

# DNS answers carry TTLs that getaddrinfo does not expose: names are re-resolved on this fixed
# interval instead, so an endpoint whose address moves is followed within half a minute.
RESOLVE_INTERVAL = 30.0


@functools.lru_cache(maxsize=65536)
def ip_literal(name: str) -> tuple[str, ...] | None:
    """The address an IP literal names (it never moves, so it is never re-resolved), else None."""
    try:
        return (str(ipaddress.ip_address(name)),)
    except ValueError:
        return None


def rejected_maps(changes: Mapping[MapKey, LuaPart | None], failed: Mapping[str, str]) -> dict[MapKey, str]:
    """The maps of `changes` with a name in `failed` (name -> why), each with its first such name's why."""
    rejected: dict[MapKey, str] = {}
    for key, part in changes.items():
        reasons = [failed[b.name] for b in part.backends if b.name in failed] if part else []
        if reasons:
            rejected[key] = reasons[0]
    return rejected


class NameCache:
    """name -> (addresses, when resolved): the addresses the pushed entries use."""

    def __init__(self, interval: float = RESOLVE_INTERVAL) -> None:
        self.interval = interval
        self._names: dict[str, tuple[tuple[str, ...], float]] = {}

    def addresses(self, name: str) -> tuple[str, ...]:
        """What an entry holds for `name`: an IP literal's own address, else its last addresses
        (KeyError for a name never resolved)."""
        return ip_literal(name) or self._names[name][0]

    def due(self, parts: Iterable[LuaPart | None], now: float, *, force: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """The names of `parts` to look up now, with a port of theirs, sorted: those not known,
        those older than the interval and those in `force`; never an IP literal."""
        # One lookup per name, whatever its ports.
        wanted = {b.name: b.port for part in parts if part is not None for b in part.backends}
        names = self._names
        return sorted(
            (name, port) for name, port in wanted.items()
            if (name in force or name not in names or now - names[name][1] > self.interval)
            and ip_literal(name) is None
        )  # fmt: skip

    def settle(
        self, looked_up: Sequence[tuple[str, int]], results: Sequence[tuple[str, ...] | BaseException], now: float
    ) -> dict[str, str]:
        """Take in one round of lookups (`results` in the order of `looked_up`): the names that did
        not resolve and have no earlier addresses, with why. An error that is not a failed lookup
        (OSError, UnicodeError) is raised."""
        failed: dict[str, str] = {}
        for (name, _), result in zip(looked_up, results):
            if isinstance(result, BaseException):
                if not isinstance(result, (OSError, UnicodeError)):
                    raise result
                if name not in self._names:
                    failed[name] = f"cannot resolve {name}: {result}"
            else:
                self._names[name] = (result, now)
        return failed

    def seed(self, addresses: Mapping[str, tuple[str, ...]], now: float) -> None:
        """Addresses read back from NGINX's table, for the names not known yet (IP literals left out)."""
        for name, held in addresses.items():
            if ip_literal(name) is None:
                self._names.setdefault(name, (held, now))

    def stale(self, now: float) -> frozenset[str]:
        """The known names older than the interval."""
        return frozenset(name for name, (_, at) in self._names.items() if now - at > self.interval)

    def refreshed(self, names: Iterable[str], now: float) -> None:
        """`names` count as resolved at `now`, whether or not their lookup succeeded (a failed
        one is tried again an interval later, not on every poll)."""
        for name in names:
            addresses, at = self._names[name]
            self._names[name] = (addresses, max(at, now))

    def forget(self, names: Iterable[str]) -> None:
        """Names no confirmed map uses any more."""
        for name in names:
            self._names.pop(name, None)
