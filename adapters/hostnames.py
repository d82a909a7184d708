"""Who serves each hostname: the engine's pure bookkeeping of hostnames, for every gateway.

Which maps the gateway serves on each hostname, the owner of each (the senior map: the older
TrafficMap, then namespace/name), the hostnames served for several maps, the claims waiting for a
hostname, and the order in which claims are written (`next_round`) so that no write ever puts two
maps on one hostname. It does no I/O and holds no routes: the engine passes its confirmed routes
in, tells it each committed change, and keeps the order of reads and writes.
"""

from __future__ import annotations

from collections.abc import Mapping

from publisher.core.values import Held, MapKey, Reason, Route

__all__ = ["Hostnames", "conflict"]


def conflict(hostname: str, owner: MapKey) -> Held:
    """The hold of a map claiming a hostname `owner` keeps."""
    return Held(
        Reason.HOST_CONFLICT,
        f"hostname {hostname} is already served for {owner}; this map is published once {owner} lets it go",
    )


class Hostnames:
    """The hostnames of the maps the gateway is confirmed to serve, and the claims on them."""

    def __init__(self) -> None:
        # Who owns each hostname, and every map the gateway serves on it: one, unless a read-back
        # found several (a gateway written by hand or by an older sidecar).
        self._owners: dict[str, MapKey] = {}
        self._served_on: dict[str, set[MapKey]] = {}
        self._duplicates: set[str] = set()
        # Each map's creationTimestamp, from the publications seen: the older claim keeps a hostname.
        self._created: dict[MapKey, str] = {}
        # The maps held as HostConflict, by the hostname each waits for.
        self._waiting: dict[MapKey, str] = {}

    def owner(self, hostname: str) -> MapKey | None:
        return self._owners.get(hostname)

    def waiting(self) -> Mapping[MapKey, str]:
        return dict(self._waiting)

    def record_created(self, key: MapKey, created: str) -> None:
        self._created[key] = created

    def stop_waiting(self, key: MapKey) -> None:
        """`key` was decided again: whatever it waited for, its new decision says."""
        self._waiting.pop(key, None)

    def rebuild(self, routes: Mapping[MapKey, Route]) -> None:
        """Start over from what a read-back found the gateway serving."""
        self._served_on = {}
        for key, route in routes.items():
            self._served_on.setdefault(route.hostname, set()).add(key)
        # A hostname nearly always has one map: it owns it without ranking (10,000 maps: a few ms).
        self._owners = {hostname: next(iter(keys)) if len(keys) == 1 else min(keys, key=self._seniority) for hostname, keys in self._served_on.items()}
        self._duplicates = {hostname for hostname, keys in self._served_on.items() if len(keys) > 1}

    def _seniority(self, key: MapKey) -> tuple[int, str, MapKey]:
        """The order in which claims on one hostname win: the older TrafficMap, then
        namespace/name; a map whose publication was never seen comes after every one that was."""
        created = self._created.get(key)
        return (0, created, key) if created is not None else (1, "", key)

    def settle_duplicates(self, wanted: dict[MapKey, Route | None], routes: Mapping[MapKey, Route], rejected: dict[MapKey, Held]) -> None:
        """A hostname the gateway serves for several maps keeps its senior one; the others are
        withdrawn from the gateway and wait as HostConflict (unless they are leaving it anyway)."""
        for hostname in self._duplicates:
            keys = self._served_on[hostname]
            owner = self._owners[hostname] = min(keys, key=self._seniority)
            for key in keys - {owner}:
                route = wanted.get(key, routes[key])
                if route is None or route.hostname != hostname:
                    continue
                wanted[key] = None
                rejected[key] = conflict(hostname, owner)
                self._waiting[key] = hostname

    def next_round(
        self, pending: Mapping[MapKey, Route | None], routes: Mapping[MapKey, Route], rejected: dict[MapKey, Held], *, may_break: bool
    ) -> tuple[dict[MapKey, Route | None], dict[MapKey, Route | None], MapKey | None]:
        """Split `pending` into what can be written now and what waits for it, holding claims on
        a hostname another map keeps as HostConflict; and the owner it withdrew to break a cycle
        of claims, if it did. `routes` are the confirmed ones.

        A claim on a hostname whose owner is itself changing waits until the owner's change was
        written: confirmed, the hostname is free; refused, failed or held, the owner keeps it.
        When nothing can be written, the claims wait on each other: maps that swap hostnames, or
        pass them round. Once a pass (`may_break`), the youngest owner among them is withdrawn on
        its own first, which frees its hostname for the next; its own claim comes rounds later.
        Each hostname of the cycle goes unserved for a write's confirmation, none is ever served
        for two maps. A cycle still stuck after that (the withdrawal refused) waits as conflicts."""
        ready: dict[MapKey, Route | None] = {}
        later: dict[MapKey, Route | None] = {}
        claims: dict[str, list[MapKey]] = {}
        for key, route in pending.items():
            if route is None:
                ready[key] = None
            else:
                claims.setdefault(route.hostname, []).append(key)
        for hostname, claimants in claims.items():
            owner = self._owners.get(hostname)
            if owner is not None and owner not in claimants:
                if owner in pending:
                    later.update((key, pending[key]) for key in claimants)
                    continue
            else:
                owner = owner if owner is not None else min(claimants, key=self._seniority)
                ready[owner] = pending[owner]
            for key in claimants:
                if key != owner:
                    rejected[key] = conflict(hostname, owner)
                    self._waiting[key] = hostname
        if not ready:
            claimed = {route.hostname for route in later.values() if route is not None}
            owners = [key for key in later if (old := routes.get(key)) is not None and self._owners.get(old.hostname) == key and old.hostname in claimed]
            if may_break and owners:
                youngest = max(owners, key=self._seniority)
                return {youngest: None}, later, youngest
            for key, route in later.items():
                assert route is not None
                rejected[key] = conflict(route.hostname, self._owners[route.hostname])
                self._waiting[key] = route.hostname
            later = {}
        return ready, later, None

    def release(self, rejected: Mapping[MapKey, Held], broken: MapKey | None) -> set[MapKey]:
        """The waiting maps to decide again, no longer waiting: those whose hostname no map
        serves (freed by this apply's writes, or never taken: their claim lost the race to a
        senior one that then failed to render or was refused, and nothing would ever free it),
        unless held now; and those of a cycle of claims the apply did not try to break."""
        released = {key for key, hostname in self._waiting.items() if hostname not in self._owners and key not in rejected}
        released |= self.unbroken_cycles(broken)
        for key in released:
            del self._waiting[key]
        return released

    def unbroken_cycles(self, broken: MapKey | None) -> set[MapKey]:
        """The maps whose claims wait on each other round a cycle (each waits for a hostname the
        next one serves) that this apply did not try to break: it saw only part of the cycle (B
        moved onto A's hostname and waits; A now moves onto B's), or it broke another one. Handed
        back to be decided again, together, the next apply breaks it. A cycle it tried to break
        (the withdrawal refused) waits for that map's retry."""
        cycles: set[MapKey] = set()
        seen: set[MapKey] = set()
        for start in self._waiting:
            path: list[MapKey] = []
            key: MapKey | None = start
            while key is not None and key in self._waiting and key not in seen:
                seen.add(key)
                path.append(key)
                key = self._owners.get(self._waiting[key])
            if key in path:
                cycle = path[path.index(key):]
                if broken not in cycle:
                    cycles.update(cycle)
        return cycles

    def commit(self, key: MapKey, old: Route | None, route: Route | None) -> None:
        """The gateway confirmed `key` moved from `old` to `route` (None: not served)."""
        if old is not None:
            served = self._served_on[old.hostname]
            served.discard(key)
            if len(served) < 2:
                self._duplicates.discard(old.hostname)
            if not served:
                del self._served_on[old.hostname]
            if self._owners.get(old.hostname) == key:
                if served:
                    self._owners[old.hostname] = min(served, key=self._seniority)
                else:
                    del self._owners[old.hostname]
        if route is None:
            return
        self._served_on.setdefault(route.hostname, set()).add(key)
        self._owners[route.hostname] = key
