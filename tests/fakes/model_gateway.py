"""A model gateway of several clients (Envoys, say), for the engine's simulation.

The `Fleet` is the clients, and outlives a sidecar: each `ModelTransport` is one sidecar's view of
it (a restart is a new transport over the same fleet, and every client connects to it again). The
transport behaves as the Transport protocol asks of a gateway with several clients:

- a write converges every connected client to the write's whole target (`parts`), so a client
  that missed an update is brought back by the next write; a map some clients refuse while others
  take it on the same hostname is held back on the refusers alone (they keep what they had) and
  comes back as `held_back` with their words (issue 30: one truth per client); a map no client
  takes, or a hostname move or withdrawal one refuses, stays as it was on every client and comes
  back rejected; it raises NotConnected with no client connected (nothing written), Unavailable
  when no client connected through the whole write acknowledged it, or when told to fail;
- `read()` reports every map some connected client serves, with the route most of them hold, and
  takes that as its target (sent at once to every client after a restart, and with the next write
  otherwise), so a client that differs is converged to what was reported; `read_page(keys)` and
  `read_others(known)` report the same of some maps and change no target;
- a client that connects is sent the target; what it refuses is reported by `refusals()`.

The fleet also records what the engine must never cause: a client serving one hostname for two
maps, and a map removed from a client although the write's `changes` did not remove it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from adapters.base import NotConnected, TransportDefaults, Unavailable, WriteResult
from publisher.core.values import MapKey, Route

# A route whose first backend has this weight cannot be rendered (the renderer raises).
UNRENDERABLE_WEIGHT = 7


@dataclass
class Client:
    name: str
    connected: bool = False
    held: dict[MapKey, Route] = field(default_factory=dict)
    # Maps this client refuses any new route for: it keeps what it holds of them.
    refuses: set[MapKey] = field(default_factory=set)


@dataclass
class Fleet:
    clients: list[Client]
    # Set by a test: the next write fails (before anything reaches a client, or after some did),
    # or one client leaves in the middle of it.
    fail_next: str | None = None  # "unavailable" | "unavailable-partial"
    leaves_next: str | None = None
    violations: list[str] = field(default_factory=list)

    def connected(self) -> list[Client]:
        return [client for client in self.clients if client.connected]

    def client(self, name: str) -> Client:
        return next(client for client in self.clients if client.name == name)

    def check_unique_hostnames(self, client: Client, why: str) -> None:
        owners: dict[str, MapKey] = {}
        for key in sorted(client.held):
            other = owners.setdefault(client.held[key].hostname, key)
            if other != key:
                self.violations.append(f"{why}: {client.name} serves {client.held[key].hostname} for {other} and {key}")


class ModelTransport(TransportDefaults):
    """One sidecar's transport over a `Fleet`, and the renderer the engine uses with it."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # What the clients are to serve; and what the engine's last write asked for and which of
        # it was refused (None after a read: the engine may then take the read as its snapshot).
        self.target: dict[MapKey, Route] | None = None
        self.asked: dict[MapKey, Route] | None = None
        self.last_refused: set[MapKey] = set()
        self._refused_later: dict[MapKey, str] = {}
        self.writes = 0

    # Renderer
    def problem(self, key: MapKey, route: Route) -> str | None:
        return None

    def render(self, key: MapKey, route: Route) -> Route:
        if route.backends and route.backends[0].weight == UNRENDERABLE_WEIGHT:
            raise RuntimeError("cannot render this route")
        return route

    # Transport
    async def read(self) -> dict[MapKey, Route]:
        served = self._most_held(lambda key: True)
        clients = self.fleet.connected()
        restarted = self.target is None
        self.target = dict(served)
        self.asked = None
        if restarted:
            for client in clients:
                self._send_target(client)
        return served

    async def read_page(self, keys: Collection[MapKey]) -> dict[MapKey, Route]:
        """`read` of `keys` alone, and no new target (as Envoy over xDS reads a page); before a
        target was made, the whole read makes it."""
        if self.target is None:
            served = await self.read()
            return {key: served[key] for key in keys if key in served}
        return self._most_held(set(keys).__contains__)

    async def read_others(self, known: Collection[MapKey]) -> dict[MapKey, Route]:
        return self._most_held(lambda key: key not in known)

    def _most_held(self, wanted: Callable[[MapKey], bool]) -> dict[MapKey, Route]:
        """The route most connected clients hold of each `wanted` map some client holds."""
        clients = self.fleet.connected()
        if not clients:
            raise NotConnected("no client connected")
        votes: dict[MapKey, Counter[Route]] = {}
        for client in clients:
            for key, route in client.held.items():
                if wanted(key):
                    votes.setdefault(key, Counter())[route] += 1
        return {key: min(counter, key=lambda route: (-counter[route], repr(route))) for key, counter in votes.items()}

    async def write(self, parts: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]) -> WriteResult:
        clients = self.fleet.connected()
        if not clients:
            raise NotConnected("no client connected")
        before = self.target if self.target is not None else {}
        new = dict(parts)
        previous = self.asked if self.asked is not None else new
        missed = {key for key in previous.keys() | new.keys() if previous.get(key) != new.get(key)} - changes.keys() - self.last_refused
        if missed:
            self.fleet.violations.append(f"changes {sorted(changes)} miss {sorted(missed)}")
        differing = {key for key in before.keys() | new.keys() if before.get(key) != new.get(key)}
        self.writes += 1
        fail, self.fleet.fail_next = self.fleet.fail_next, None
        if fail == "unavailable":
            raise Unavailable("timed out before any client answered")
        # A map is sent to a client when it changed, or when the engine names it again (a retry).
        asked = differing | {key for key, part in changes.items() if part is not None}
        refused: dict[MapKey, str] = {}
        held_back: dict[MapKey, str] = {}
        for client in clients:
            for key in asked & client.refuses:
                if new.get(key) is not None and client.held.get(key) != new[key]:
                    refused.setdefault(key, f"{client.name} refused {key}")
        leaving, self.fleet.leaves_next = self.fleet.leaves_next, None
        for key in list(refused):
            takers = [client for client in clients if key not in client.refuses and client.name != leaving]
            if takers and (key not in before or before[key].hostname == new[key].hostname):
                held_back[key] = refused.pop(key)
            elif key in before:
                new[key] = before[key]
            else:
                new.pop(key, None)
        reached = clients[: len(clients) // 2] if fail == "unavailable-partial" else clients
        for client in reached:
            if client.name != leaving:  # one that leaves is gone before it takes this write
                self._converge(client, new, before, changes)
        self.target = new
        self.asked, self.last_refused = dict(parts), set(refused)
        if fail == "unavailable-partial":
            raise Unavailable("timed out confirming")
        if leaving is not None:
            self.fleet.client(leaving).connected = False
            if not self.fleet.connected():
                raise Unavailable("the only client left before acknowledging")
        return WriteResult(rejected=refused, held_back=held_back)

    def refusals(self) -> dict[MapKey, str]:
        refused, self._refused_later = self._refused_later, {}
        return refused

    # The fleet's side
    def connect(self, client: Client) -> None:
        client.connected = True
        self._send_target(client)

    def _send_target(self, client: Client) -> None:
        """What a transport does for a client that connects: send it the target. A map it refuses
        it does not serve (a simplification: a real client might keep an older route of it), and
        the refusal is reported by `refusals()`."""
        if self.target is None:
            return
        new = dict(self.target)
        for key in client.refuses & new.keys():
            if client.held.get(key) != new[key]:
                self._refused_later[key] = f"{client.name} refused {key} when it connected"
                del new[key]
        client.held = new
        self.fleet.check_unique_hostnames(client, "on connect")

    def _converge(
        self, client: Client, target: Mapping[MapKey, Route], before: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]
    ) -> None:
        held: dict[MapKey, Route] = {}
        for key in client.held.keys() | target.keys():
            want, have = target.get(key), client.held.get(key)
            if want is None:
                if have is not None and (key not in changes or changes[key] is not None):
                    self.fleet.violations.append(f"{key} was removed from {client.name} though the engine did not remove it")
                continue
            if key in client.refuses and want != have:
                # It keeps the route it had where the rest of the fleet keeps it too, or on the
                # hostname the map keeps (held back on it alone), as an Envoy does.
                if have is not None and (have == before.get(key) or have.hostname == want.hostname):
                    held[key] = have
                continue
            held[key] = want
        client.held = held
        self.fleet.check_unique_hostnames(client, "after a write")
