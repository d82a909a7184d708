"""A simulation of the engine under partial failure and many clients (issue 21).

A Hypothesis state machine drives the real loop and the real `Engine` over a model gateway of
three clients (tests/fakes/model_gateway.py) through random sequences of: map changes, hostname
claims, moves and withdrawals, routes that fail to render, a refusal by one client, a write that
is Unavailable before or after reaching some clients, no client connected (NotConnected), a client
that connects late (and refuses), leaves in the middle of a write or comes back empty, a map the
gateway loses behind the transport's back, resyncs,
and a sidecar restart (a new engine and loop over the same clients).

After every step: no client serves one hostname for two maps, and nothing is removed from a
client that the engine did not ask to remove. After a quiet spell (`settle`: no faults, time
passes beyond every backoff, resyncs run): when no map's route is refused, unrenderable or on
another map's hostname, every map is published; every map reported published is served, as confirmed,
by every connected client; every map a connected client refuses is not reported published (so a
refusal is reported within one resync); and what the engine confirmed is what the clients serve.

Clients refuse persistently (`client_refuses`) while others accept: a map's newest weights reach
every client that takes them, and are held back on the refusers alone (issue 30; the model
gateway holds them back as the xDS transport does).

Run against the engine and loop of 91c9cd5 (the model's NotConnected taken as the Unavailable it
subclasses), seeds of 1,000 examples failed, shrunk to a few steps each:
- finding 1, "after a write: envoy-1 serves h0.example.com for prod/m0 and prod/m1": set_map(m0, h0),
  set_map(m1, h0), resync, set_map(m0, h1, an unrenderable route), resync (m1 was granted m0's
  hostname before m0's move had landed; also with h1 owned by a third map);
- finding 4, "prod/m0 is reported published but envoy-0 serves None": set_map(m0, h0), resync,
  client_leaves(envoy-0), client_refuses(envoy-0, m0), client_connects(envoy-0), settle;
- finding 5, "prod/m1 is reported published but not confirmed": client_leaves(envoy-0),
  set_map(m1, h0), resync, gateway_loses_a_map(m1), next_write_fails(unavailable), set_map(m0, h0),
  resync (the read-back after the unknown write dropped m1 from the snapshot without a word);
- and a write in doubt that reached one client of two: "envoy-0 serves {}, the engine confirmed
  {prod/m2: ...}" (clients left disagreeing on a map the read-back showed unchanged).

Maps that swap hostnames waited on each other for ever (found by hand: `swap_hostnames` is its
rule). Against the engine of 4ef453b the liveness promise also failed with 3,000 examples on:
set_map(m0, h1, an unrenderable route), set_map(m1, h1), run_pass, delete_map(m0), settle ("prod/m1
is held HostConflict with every hostname its own": m0 never served h1, so nothing freed it); and,
with the liveness fixes, "prod/m2 is reported published but envoy-2 serves None" (the last test
below).

A swap done in two steps (`swap_hostnames_in_two_steps`: B onto A's hostname, held; then A onto
B's old one) left both maps HostConflict until the next full resync, which `settle` does not run;
random exploration found it and stored it in .hypothesis/, so every later run failed (issue 27,
item 15; the deterministic test below).

By default (tests/conftest.py) the simulation runs 200 fixed examples: derandomized, no example
database, so a run passes or fails on the code alone, as CI needs. OME_SIMULATION_EXAMPLES=2000
(say) explores at random, that many examples, and keeps what it finds in .hypothesis/.
"""

from __future__ import annotations

import asyncio
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from adapters.engine import Engine
from publisher.loop import LoopOptions, Publisher
from publisher.core.model import parse_traffic_map
from publisher.core.values import MapKey, Route
from publisher.source.objects import parse_isvc
from publisher.source.store import Stores
from tests.builders import make_entry, make_isvc, make_map
from tests.fakes.model_gateway import UNRENDERABLE_WEIGHT, Client, Fleet, ModelTransport

NAMES = ["m0", "m1", "m2"]
HOSTS = ["h0.example.com", "h1.example.com"]
CLIENTS = ["envoy-0", "envoy-1", "envoy-2"]
EXAMPLES = int(os.environ.get("OME_SIMULATION_EXAMPLES", "200"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class EngineSimulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fleet = Fleet([Client(CLIENTS[0], connected=True), Client(CLIENTS[1], connected=True), Client(CLIENTS[2])])
        self.clock = Clock()
        self.stores = Stores.empty()
        self.version = 0
        self.desired: dict[MapKey, tuple[str, int]] = {}  # each map's hostname and weight, as last set
        self._new_sidecar()

    def teardown(self) -> None:
        try:
            self.settle()
        finally:
            self.loop.close()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def _new_sidecar(self) -> None:
        """A sidecar (re)starts: a new transport, engine and loop; every client connects to it."""
        self.transport = ModelTransport(self.fleet)
        for client in self.fleet.connected():
            self.transport.connect(client)
        self.engine = Engine("model", self.transport, self.transport)
        self.publisher = Publisher(self.stores, self.engine, LoopOptions(adapter_name="model", backoff_cap=4.0), clock=self.clock)
        self.run(self.publisher.start())
        self.publisher.synced()
        self._pass()

    def _pass(self) -> None:
        self.run(self.publisher.sync_once(self.publisher.queue.take_ready()))

    # --- the source -------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), host=st.sampled_from(HOSTS), weight=st.sampled_from([1, 2, UNRENDERABLE_WEIGHT]))
    def set_map(self, name: str, host: str, weight: int) -> None:
        """A map is created or changed (new weights, a hostname claimed or moved to); the next
        pass takes it, with whatever else changed meanwhile."""
        self.version += 1
        created = f"2026-01-0{NAMES.index(name) + 1}T00:00:00Z"
        raw = make_map(name, resource_version=str(self.version), metadata={"creationTimestamp": created},
                       entries=[make_entry("worker-a", allocated=weight, ready=weight, weight=weight, service=name),
                                make_entry("worker-b", allocated=1, ready=1, weight=1, service=name)])
        isvc = make_isvc(name, host=host, capacity_factors={}, resource_version=str(self.version))
        tm = parse_traffic_map(raw)
        self.desired[tm.key] = (host, weight)
        self.stores.maps.upsert(tm.key, tm, str(self.version))
        self.stores.isvcs.upsert(tm.key, parse_isvc(isvc), str(self.version))
        self.publisher.changed([tm.key], at=self.clock.now)

    def _two_set(self, order: list[str]) -> tuple[tuple[str, str, int], tuple[str, str, int]]:
        """The first two maps in `order` that are set, each as its name, hostname and weight."""
        first, second = [(name, *self.desired[key]) for name in order if (key := MapKey("prod", name)) in self.desired][:2]
        return first, second

    @precondition(lambda self: len(self.desired) >= 2)
    @rule(order=st.permutations(NAMES))
    def swap_hostnames(self, order: list[str]) -> None:
        """Two maps trade hostnames in one pass (a blue/green by hostname), each keeping its weights."""
        (first, host_a, weight_a), (second, host_b, weight_b) = self._two_set(order)
        self.set_map(first, host_b, weight_a)
        self.set_map(second, host_a, weight_b)

    @precondition(lambda self: len(self.desired) >= 2)
    @rule(order=st.permutations(NAMES))
    def swap_hostnames_in_two_steps(self, order: list[str]) -> None:
        """Two maps trade hostnames in two passes: the second moves onto the first's hostname (and
        waits for it), then the first moves onto the second's old one (issue 27, item 15)."""
        (first, host_a, weight_a), (second, host_b, weight_b) = self._two_set(order)
        self.set_map(second, host_a, weight_b)
        self._pass()
        self.set_map(first, host_b, weight_a)

    @rule(name=st.sampled_from(NAMES))
    def delete_map(self, name: str) -> None:
        key = MapKey("prod", name)
        self.desired.pop(key, None)
        self.stores.maps.delete(key)
        self.publisher.changed([key], at=self.clock.now)

    @rule()
    def run_pass(self) -> None:
        self._pass()

    # --- the clients ------------------------------------------------------------------------------

    @rule(client=st.sampled_from(CLIENTS), name=st.sampled_from(NAMES), refuses=st.booleans())
    def client_refuses(self, client: str, name: str, refuses: bool) -> None:
        target = self.fleet.client(client).refuses
        (target.add if refuses else target.discard)(MapKey("prod", name))

    @rule(kind=st.sampled_from(["unavailable", "unavailable-partial"]))
    def next_write_fails(self, kind: str) -> None:
        self.fleet.fail_next = kind

    @rule(client=st.sampled_from(CLIENTS))
    def client_leaves_during_the_next_write(self, client: str) -> None:
        if self.fleet.client(client).connected:
            self.fleet.leaves_next = client

    @rule(client=st.sampled_from(CLIENTS))
    def client_leaves(self, client: str) -> None:
        self.fleet.client(client).connected = False

    @precondition(lambda self: len(self.fleet.connected()) == 1)
    @rule(name=st.sampled_from(NAMES))
    def gateway_loses_a_map(self, name: str) -> None:
        """A gateway of one client drops a map behind the engine's back (an NGINX whose table a
        restart emptied; a hand), and the transport's own state with it: only a read-back sees it.
        (A transport of several clients knows what each acknowledged: none loses a map silently.)"""
        key = MapKey("prod", name)
        self.fleet.connected()[0].held.pop(key, None)
        if self.transport.target is not None:
            self.transport.target.pop(key, None)

    @rule(client=st.sampled_from(CLIENTS), empty=st.booleans())
    def client_connects(self, client: str, empty: bool) -> None:
        """A client connects late, or comes back (with what it held, or empty)."""
        model = self.fleet.client(client)
        if not model.connected:
            if empty:
                model.held = {}
            self.transport.connect(model)

    # --- the sidecar -------------------------------------------------------------------------------

    @rule()
    def time_passes(self) -> None:
        """Backoffs run out: the maps waiting for a retry are decided and written again."""
        self.clock.now += 6.0
        self._pass()

    @rule()
    def resync(self) -> None:
        self.run(self.publisher.reconcile())
        self.publisher.changed(self.publisher.all_keys(), at=self.clock.now)
        self._pass()

    @rule(size=st.integers(min_value=1, max_value=3))
    def resync_in_pages(self, size: int) -> None:
        """A resync reading the gateway back a page of maps at a time (issue 29), each page's
        maps decided again after it; the last page also reads what else the clients serve."""
        keys = sorted(self.publisher.all_keys())
        pages = [keys[start : start + size] for start in range(0, len(keys), size)] or [[]]
        for index, page in enumerate(pages):
            self.run(self.publisher.reconcile((page, index == len(pages) - 1)))
            self.publisher.changed(page, at=self.clock.now)
            self._pass()

    @precondition(lambda self: bool(self.fleet.connected()))
    @rule()
    def sidecar_restarts(self) -> None:
        self._new_sidecar()

    @rule()
    def settle(self) -> None:
        """A quiet spell: no faults, every backoff runs out, resyncs read the gateway back (no
        full re-decide); then the promises. Then full resyncs, and the snapshot is what is served."""
        self.fleet.fail_next = self.fleet.leaves_next = None
        for _ in range(6):
            self.clock.now += 6.0
            self.run(self.publisher.reconcile())
            self._pass()
        if not self.fleet.connected():
            return
        hosts = [host for host, _ in self.desired.values()]
        refused = set().union(*(client.refuses for client in self.fleet.connected()))
        if len(set(hosts)) == len(hosts) and not refused & self.desired.keys() and all(w != UNRENDERABLE_WEIGHT for _, w in self.desired.values()):
            # Nothing stands in any map's way: each one is published (maps that swapped hostnames too).
            for key in self.desired:
                state = self.publisher.states.get(key)
                assert state is not None and state.state == "published", f"{key} is {state} with every hostname its own"
        for key, state in self.publisher.states.items():
            if state.state == "published":
                route = self.publisher.provenance[key].route
                assert self.engine.confirmed.get(key) == route, f"{key} is reported published but not confirmed"
                for client in self.fleet.connected():
                    assert client.held.get(key) == route, f"{key} is reported published but {client.name} serves {client.held.get(key)}"
        for client in self.fleet.connected():
            for key in client.refuses:
                state = self.publisher.states.get(key)
                if state is not None and state.state == "published":
                    assert client.held.get(key) == self.publisher.provenance[key].route, f"{client.name} refuses {key}, reported published"
        # One truth per client (issue 30): a map's newest weights reach every client that takes
        # them, whatever the others refuse, persistently (only a hostname move waits for all).
        for key, (host, weight) in self.desired.items():
            confirmed = self.engine.confirmed.get(key)
            takers = [client for client in self.fleet.connected() if key not in client.refuses]
            if hosts.count(host) > 1 or weight == UNRENDERABLE_WEIGHT or not takers or confirmed is None or confirmed.hostname != host:
                continue
            assert confirmed.backends[0].weight == weight, f"{key}: the engine confirmed {confirmed}, the newest weight is {weight}"
            for client in takers:
                assert client.held.get(key) == confirmed, f"{client.name} serves {client.held.get(key)} for {key}, the newest is {confirmed}"
        for _ in range(2):
            self.resync()
        # What some client refuses is the gateway's previous state; the rest is what was confirmed.
        refused = set().union(*(client.refuses for client in self.fleet.connected()))
        expected: dict[MapKey, Route] = {key: route for key, route in self.engine.confirmed.items() if key not in refused}
        for client in self.fleet.connected():
            served = {key: route for key, route in client.held.items() if key not in refused}
            assert served == expected, f"{client.name} serves {served}, the engine confirmed {expected}"

    # --- after every step ----------------------------------------------------------------------------

    @invariant()
    def no_client_breaks_a_promise(self) -> None:
        assert self.fleet.violations == []


EngineSimulation.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_engine_simulation = EngineSimulation.TestCase


def test_a_refusal_found_by_the_read_back_after_a_write_in_doubt_is_kept():
    # Found by this simulation (3,000 examples): the read-back after an unknown write reported a
    # late client's refusal but did not keep it, so the map's next pass wrote nothing and was
    # reported published while that client served nothing of it.
    state = EngineSimulation()
    state.set_map(host=HOSTS[1], name="m2", weight=1)
    state.client_refuses(client="envoy-2", name="m2", refuses=True)
    state.set_map(host=HOSTS[0], name="m0", weight=1)
    state.resync()
    state.delete_map(name="m0")
    state.next_write_fails(kind="unavailable")
    state.resync()
    state.client_connects(client="envoy-2", empty=False)
    state.teardown()


def test_a_hostname_swap_in_two_steps_is_published_without_a_full_resync():
    # Issue 27, item 15: both maps stayed HostConflict through settle's quiet spell (reconciles,
    # no full re-decide), as in a sidecar until the next --resync.
    state = EngineSimulation()
    state.set_map(name="m0", host=HOSTS[0], weight=1)
    state.set_map(name="m1", host=HOSTS[1], weight=2)
    state.run_pass()
    state.swap_hostnames_in_two_steps(order=["m0", "m1", "m2"])
    state.settle()
    state.teardown()
