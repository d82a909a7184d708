"""The engine on its own, over the strict in-memory gateway: hostname ownership, isolation by
bisection, the confirmed snapshot, read-back and drift repair."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from adapters.base import Rejected, Unavailable, WriteResult
from adapters.engine import Engine
from publisher.core.values import Backend, MapKey, Publication, Reason, Route
from tests.loop_turns import loop_turns
from tests.fakes.memory_adapter import MemoryGateway, memory_engine


def pub(name: str, *weights: int, host: str | None = None, created: str = "2026-01-01T00:00:00Z", generation: int = 1) -> Publication:
    return Publication("prod", name, host or f"{name}.example.com", generation, 1,
                       tuple(Backend(f"w{i}", f"http://{name}.w{i}.example.com", w) for i, w in enumerate(weights)), created)


def changes(*pubs: Publication) -> dict[MapKey, Publication | None]:
    return {p.key: p for p in pubs}


class RefusingGateway(MemoryGateway):
    """Refuses any whole write holding a map in `bad`, as a gateway that cannot say which map it was."""

    bad: set[MapKey] = set()

    async def write(self, parts: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]) -> WriteResult:
        if self.bad & set(changes):
            self.applies.append(frozenset(changes))
            raise Rejected("invalid configuration")
        return await super().write(parts, changes)


async def test_one_refused_map_among_many_is_isolated_and_the_rest_publish():
    """Issue 11, finding 5: 1 bad map among 5 good ones used to fail all 6."""
    gateway = RefusingGateway()
    gateway.bad = {MapKey("prod", "bad")}
    engine = Engine("memory", gateway, gateway)
    await engine.start()
    good = [pub(f"good{i}", 1, 2) for i in range(5)]
    result = await engine.apply(changes(*good, pub("bad", 1)))
    assert set(result.rejected) == {MapKey("prod", "bad")}
    assert result.rejected[MapKey("prod", "bad")].reason == Reason.APPLY_FAILED
    assert "invalid configuration" in result.rejected[MapKey("prod", "bad")].message
    assert set(gateway.held) == {p.key for p in good}
    assert set(engine.confirmed) == {p.key for p in good}


async def test_second_claim_on_a_hostname_is_held_until_the_owner_lets_go():
    """Issue 11, finding 4: two maps with one hostname both used to report Published."""
    engine, gateway = memory_engine()
    await engine.start()
    older = pub("chat", 1, host="chat.example.com", created="2026-01-01T00:00:00Z")
    newer = pub("chat-copy", 2, host="chat.example.com", created="2026-02-01T00:00:00Z")
    result = await engine.apply(changes(newer, older))
    assert set(gateway.held) == {older.key}
    held = result.rejected[newer.key]
    assert held.reason == Reason.HOST_CONFLICT and "prod/chat" in held.message
    # The owner moves to another hostname: the waiting map is released and then publishes.
    moved = pub("chat", 1, host="chat-v2.example.com")
    result = await engine.apply(changes(moved))
    assert result.released == {newer.key}
    assert not (await engine.apply(changes(newer))).rejected
    assert gateway.held[newer.key].hostname == "chat.example.com"


async def test_the_older_claim_wins_whatever_the_order_of_arrival():
    for order in ((0, 1), (1, 0)):
        engine, gateway = memory_engine()
        await engine.start()
        pubs = [pub("b", 1, host="x.example.com", created="2026-01-01T00:00:00Z"),
                pub("a", 1, host="x.example.com", created="2026-03-01T00:00:00Z")]
        await engine.apply(changes(*(pubs[i] for i in order)))
        assert set(gateway.held) == {MapKey("prod", "b")}


async def test_the_serving_map_keeps_its_hostname_after_a_restart():
    gateway = MemoryGateway(held={MapKey("prod", "young"): pub("young", 1, host="x.example.com").route})
    engine, _ = memory_engine(gateway)
    await engine.start()
    result = await engine.apply(changes(pub("old", 1, host="x.example.com", created="2020-01-01T00:00:00Z")))
    assert result.rejected[MapKey("prod", "old")].reason == Reason.HOST_CONFLICT


class Exploding(MemoryGateway):
    """Its renderer fails on the map named boom, as a renderer bug would."""

    def render(self, key: MapKey, route: Route) -> Route:
        if key.name == "boom":
            raise RuntimeError("renderer bug")
        return route


async def test_a_renderer_error_holds_only_that_map():
    gateway = Exploding()
    engine = Engine("memory", gateway, gateway)
    await engine.start()
    result = await engine.apply(changes(pub("boom", 1), pub("fine", 1)))
    assert result.rejected[MapKey("prod", "boom")].reason == Reason.INTERNAL_ERROR
    # In words, not the exception's repr (issue 23, point 7).
    assert result.rejected[MapKey("prod", "boom")].message == "rendering for the memory gateway failed: RuntimeError: renderer bug"
    assert set(gateway.held) == {MapKey("prod", "fine")}


async def test_a_claim_that_lost_to_a_map_that_never_got_the_hostname_is_released():
    # Found by the engine simulation's liveness promise: the senior claim failed to render, so no
    # map ever served the hostname and nothing freed it; the junior waited as HostConflict for ever.
    gateway = Exploding()
    engine = Engine("memory", gateway, gateway)
    await engine.start()
    senior = pub("boom", 1, host="x.example.com", created="2026-01-01T00:00:00Z")
    junior = pub("fine", 1, host="x.example.com", created="2026-02-01T00:00:00Z")
    result = await engine.apply(changes(senior, junior))
    assert result.rejected[senior.key].reason == Reason.INTERNAL_ERROR
    assert result.rejected[junior.key].reason == Reason.HOST_CONFLICT
    # The next pass (here: the senior map deleted) lets the junior one be decided again.
    result = await engine.apply({senior.key: None})
    assert result.released == {junior.key}
    assert not (await engine.apply(changes(junior))).rejected
    assert gateway.held == {junior.key: junior.route}


async def test_an_unconfirmed_write_is_read_back_before_the_next_one():
    gateway = MemoryGateway(fail_with=[Unavailable("timed out confirming")])
    engine, _ = memory_engine(gateway)
    await engine.start()
    with pytest.raises(Unavailable):
        await engine.apply(changes(pub("a", 1)))
    reads = gateway.reads
    await engine.apply(changes(pub("a", 1)))
    assert gateway.reads == reads + 1
    assert MapKey("prod", "a") in engine.confirmed


async def test_reconcile_writes_back_what_drifted_and_never_adopts_it():
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1), pub("b", 2)))
    gateway.held[MapKey("prod", "a")] = pub("a", 9).route
    gateway.held[MapKey("prod", "stray")] = pub("stray", 1).route
    del gateway.held[MapKey("prod", "b")]
    done = await engine.reconcile()
    assert done.repaired == {MapKey("prod", "a"), MapKey("prod", "b"), MapKey("prod", "stray")}
    assert gateway.held == {MapKey("prod", "a"): pub("a", 1).route, MapKey("prod", "b"): pub("b", 2).route}
    assert (await engine.reconcile()).repaired == frozenset()


async def test_an_unchanged_route_writes_nothing():
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1, generation=1)))
    result = await engine.apply(changes(pub("a", 1, generation=2)))
    assert not result.wrote and len(gateway.applies) == 1


def test_check_runs_the_shared_strict_checks_for_every_gateway():
    engine, _ = memory_engine()
    assert engine.check(pub("a", 1, host="a.example.com\n location /x { return 200; }")).reason == Reason.INVALID_PLAN
    assert engine.check(pub("a", 1)) is None


# --- issue 21: one owner per hostname, read-backs, refusals outside a write -------------------------


def hostnames_served_twice(held: Mapping[MapKey, Route]) -> dict[str, list[MapKey]]:
    served: dict[str, list[MapKey]] = {}
    for key, route in sorted(held.items()):
        served.setdefault(route.hostname, []).append(key)
    return {hostname: keys for hostname, keys in served.items() if len(keys) > 1}


A, B, C = MapKey("prod", "a"), MapKey("prod", "b"), MapKey("prod", "c")


async def test_a_claim_waits_while_the_owner_cannot_move_to_a_hostname_a_third_map_owns():
    """Finding 1: A moves from h to h2, which C owns, and B asks for h: B was granted h although A
    (HostConflict) stayed on it, so the gateway served h for two maps."""
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1, host="h.example.com"), pub("c", 1, host="h2.example.com")))
    result = await engine.apply(changes(pub("a", 2, host="h2.example.com"), pub("b", 1, host="h.example.com")))
    assert hostnames_served_twice(gateway.held) == {}
    assert result.rejected[A].reason == Reason.HOST_CONFLICT and "prod/c" in result.rejected[A].message
    assert result.rejected[B].reason == Reason.HOST_CONFLICT and "prod/a" in result.rejected[B].message
    assert engine.confirmed[A].hostname == "h.example.com" and B not in engine.confirmed


async def test_a_claim_waits_while_the_owner_s_new_route_fails_to_render():
    """Finding 1: A's new route raised in the renderer (InternalError), yet B was granted A's hostname."""

    class Exploding(MemoryGateway):
        def render(self, key: MapKey, route: Route) -> Route:
            if key == A and route.hostname == "h2.example.com":
                raise RuntimeError("renderer bug")
            return route

    gateway = Exploding()
    engine = Engine("memory", gateway, gateway)
    await engine.start()
    await engine.apply(changes(pub("a", 1, host="h.example.com")))
    result = await engine.apply(changes(pub("a", 1, host="h2.example.com"), pub("b", 1, host="h.example.com")))
    assert hostnames_served_twice(gateway.held) == {}
    assert result.rejected[A].reason == Reason.INTERNAL_ERROR
    assert result.rejected[B].reason == Reason.HOST_CONFLICT
    assert set(gateway.held) == {A}


async def test_bisection_never_writes_a_claim_while_the_write_freeing_its_hostname_is_refused():
    """Finding 1: bisection wrote B's half (B on h) while A's half (A leaving h) was refused."""
    gateway = RefusingGateway()
    engine = Engine("memory", gateway, gateway)
    await engine.start()
    await engine.apply(changes(pub("a", 1, host="h.example.com")))
    gateway.bad = {A}
    result = await engine.apply(changes(pub("a", 1, host="h2.example.com"), pub("b", 1, host="h.example.com")))
    assert hostnames_served_twice(gateway.held) == {}
    assert result.rejected[A].reason == Reason.APPLY_FAILED
    assert result.rejected[B].reason == Reason.HOST_CONFLICT
    # Once A's move lands, B is released and takes h.
    gateway.bad = set()
    result = await engine.apply(changes(pub("a", 1, host="h2.example.com")))
    assert result.released == {B}
    assert not (await engine.apply(changes(pub("b", 1, host="h.example.com")))).rejected
    assert gateway.held[B].hostname == "h.example.com" and gateway.held[A].hostname == "h2.example.com"


async def test_a_hostname_freed_by_a_confirmed_move_is_granted_in_the_same_apply():
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1, host="h.example.com")))
    result = await engine.apply(changes(pub("a", 1, host="h2.example.com"), pub("b", 1, host="h.example.com")))
    assert not result.rejected
    assert gateway.held[A].hostname == "h2.example.com" and gateway.held[B].hostname == "h.example.com"
    # A write of A's move, then one of B's claim: never both in one write.
    assert gateway.applies[-2:] == [frozenset({A}), frozenset({B})]


async def test_after_a_read_back_holding_one_hostname_twice_the_older_map_keeps_it(tmp_path):
    """Finding 1: with --json-dir, two map files carried one hostname and both maps were Published;
    after such a read-back the owner was picked by key order, not the older TrafficMap."""
    from adapters import ADAPTERS
    from adapters.json import JsonOptions
    from adapters.json.render import map_file

    engine = ADAPTERS["json"].engine("json", JsonOptions(json_dir=tmp_path))
    await engine.start()
    older = pub("b", 1, host="h.example.com", created="2026-01-01T00:00:00Z")
    younger = pub("a", 2, host="h.example.com", created="2026-02-01T00:00:00Z")
    await engine.apply(changes(older))
    # A second file for the same hostname, as a hand or an older sidecar left it.
    (tmp_path / map_file(younger.key)).write_bytes(engine._renderer.render(younger.key, younger.route) + b"\n")
    restarted = ADAPTERS["json"].engine("json", JsonOptions(json_dir=tmp_path))
    assert set(await restarted.start()) == {older.key, younger.key}
    result = await restarted.apply(changes(younger, older))
    assert result.rejected[younger.key].reason == Reason.HOST_CONFLICT
    assert older.key not in result.rejected
    assert sorted(p.name for p in tmp_path.glob("prod_*.json")) == [map_file(older.key)]
    assert set(restarted.confirmed) == {older.key}


async def test_maps_a_read_back_finds_lost_are_decided_again():
    """Finding 5: after Unavailable the read-back dropped maps the gateway had lost from the
    snapshot without a word: they stayed "published" and nothing rewrote them."""
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1), pub("b", 2)))
    gateway.fail_with = [Unavailable("timed out confirming")]
    with pytest.raises(Unavailable):
        await engine.apply(changes(pub("c", 1)))
    del gateway.held[B]  # the gateway lost b meanwhile (a restart, a hand)
    result = await engine.apply(changes(pub("c", 1)))
    assert B in result.released
    assert (await engine.apply(changes(pub("b", 2)))).wrote
    assert gateway.held[B] == pub("b", 2).route


async def test_a_refusal_outside_a_write_is_reported_and_the_map_written_again():
    """Finding 4: a client that connected later and refused a map left it Published, and every
    resync re-sent it, dropped the refusal and counted it as repaired."""
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1), pub("b", 1)))
    gateway.refused_later = {A: "late envoy: unknown cluster"}
    done = await engine.reconcile()
    assert done.refused[A].reason == Reason.APPLY_FAILED and "late envoy: unknown cluster" in done.refused[A].message
    assert not done.repaired
    # The retry writes the same route again, though it is unchanged.
    writes = len(gateway.applies)
    result = await engine.apply(changes(pub("a", 1)))
    assert result.wrote and len(gateway.applies) == writes + 1 and not result.rejected
    assert not (await engine.apply(changes(pub("a", 1)))).wrote


async def test_a_repair_the_gateway_refuses_is_a_refusal_not_a_repair():
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1)))
    del gateway.held[A]
    gateway.reject = {A: "refused again"}
    done = await engine.reconcile()
    assert not done.repaired and done.refused[A].reason == Reason.APPLY_FAILED


async def test_not_connected_writes_nothing_and_needs_no_read_back():
    from adapters.base import NotConnected

    gateway = MemoryGateway(fail_with=[NotConnected("no Envoy connected")])
    engine, _ = memory_engine(gateway)
    await engine.start()
    with pytest.raises(NotConnected):
        await engine.apply(changes(pub("a", 1)))
    reads = gateway.reads
    await engine.apply(changes(pub("a", 1)))
    assert gateway.reads == reads and A in engine.confirmed


# --- issue 27: a cycle of claims the engine saw only part of ---------------------------------------


async def test_a_hostname_swap_in_two_steps_is_handed_back_whole_and_then_done():
    """Item 15: B moved onto A's hostname (held, rightly), then A onto B's: each waited for the
    other and nothing decided B again until the next full resync (52 s, both HostConflict)."""
    engine, gateway = memory_engine()
    await engine.start()
    a_on_h, b_on_h2 = pub("a", 1, host="h.example.com", created="2026-01-01T00:00:00Z"), pub("b", 1, host="h2.example.com", created="2026-02-01T00:00:00Z")
    await engine.apply(changes(a_on_h, b_on_h2))
    b_on_h = pub("b", 1, host="h.example.com", created="2026-02-01T00:00:00Z")
    result = await engine.apply(changes(b_on_h))
    assert result.rejected[B].reason == Reason.HOST_CONFLICT and not result.released
    a_on_h2 = pub("a", 1, host="h2.example.com", created="2026-01-01T00:00:00Z")
    result = await engine.apply(changes(a_on_h2))
    assert result.rejected[A].reason == Reason.HOST_CONFLICT
    # Both are handed back, to be decided again together: the swap is then a one-step swap.
    assert result.released == {A, B}
    assert not (await engine.apply(changes(a_on_h2, b_on_h))).rejected
    assert gateway.held == {A: a_on_h2.route, B: b_on_h.route}


async def test_hostnames_passed_round_in_three_steps_are_handed_back_whole_and_then_passed():
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(*(pub(name, 1, host=f"h{name}.example.com") for name in "abc")))
    moved = {name: pub(name, 1, host=f"h{after}.example.com") for name, after in zip("abc", "bca")}
    assert (await engine.apply(changes(moved["a"]))).rejected[A].reason == Reason.HOST_CONFLICT
    assert (await engine.apply(changes(moved["b"]))).rejected[B].reason == Reason.HOST_CONFLICT
    result = await engine.apply(changes(moved["c"]))
    assert result.rejected[C].reason == Reason.HOST_CONFLICT and result.released == {A, B, C}
    assert not (await engine.apply(changes(*moved.values()))).rejected
    assert gateway.held == {p.key: p.route for p in moved.values()}


async def test_two_swaps_in_one_apply_are_both_done():
    """The engine breaks one cycle of claims per apply: the second swap of the same pass waited
    as HostConflict for the next full resync. It is handed back and done in the next apply."""
    engine, gateway = memory_engine()
    await engine.start()
    before = [pub(name, 1, host=f"{host}.example.com") for name, host in (("a", "h1"), ("b", "h2"), ("c", "h3"), ("d", "h4"))]
    await engine.apply(changes(*before))
    after = [pub(name, 1, host=f"{host}.example.com") for name, host in (("a", "h2"), ("b", "h1"), ("c", "h4"), ("d", "h3"))]
    result = await engine.apply(changes(*after))
    assert result.released == set(result.rejected) and len(result.released) == 2
    assert not (await engine.apply(changes(*(p for p in after if p.key in result.released)))).rejected
    assert gateway.held == {p.key: p.route for p in after}


async def test_a_swap_whose_withdrawal_is_refused_is_not_handed_back_at_once():
    """A cycle the engine tried to break (the youngest's withdrawal refused) waits for that map's
    own retry: handing it back at once would decide it again on every pass."""
    engine, gateway = memory_engine()
    await engine.start()
    await engine.apply(changes(pub("a", 1, host="h.example.com", created="2026-01-01T00:00:00Z"),
                               pub("b", 1, host="h2.example.com", created="2026-02-01T00:00:00Z")))
    gateway.reject = {B: "no"}
    result = await engine.apply(changes(pub("a", 1, host="h2.example.com", created="2026-01-01T00:00:00Z"),
                                        pub("b", 1, host="h.example.com", created="2026-02-01T00:00:00Z")))
    assert result.rejected[B].reason == Reason.APPLY_FAILED and result.rejected[A].reason == Reason.HOST_CONFLICT
    assert not result.released
    assert hostnames_served_twice(gateway.held) == {}


class CountingGateway(MemoryGateway):
    """Counts the maps rendered."""

    renders: int = 0

    def render(self, key: MapKey, route: Route) -> Route:
        self.renders += 1
        return route


async def test_a_read_back_of_many_maps_gives_the_event_loop_back_between_slices():
    # Issue 29: at start and at each read-back after a write in doubt, 10,000 maps were rendered
    # again in one turn of the event loop (100-170 ms for Envoy's resources), and every write,
    # scrape and xDS push of that moment waited behind it.
    gateway = CountingGateway(held={p.key: p.route for p in (pub(f"m{i}", 1, 2) for i in range(5000))})
    engine, _ = memory_engine(gateway)
    async with loop_turns() as turns:
        await engine.start()
        assert turns() >= 10, f"a read-back of 5,000 maps let other tasks run {turns()} times"
    assert len(engine.confirmed) == 5000 and gateway.renders == 5000


async def test_a_read_back_renders_again_only_the_maps_whose_route_changed():
    gateway = CountingGateway(held={p.key: p.route for p in (pub(f"m{i}", 1, 2) for i in range(100))})
    engine, _ = memory_engine(gateway)
    await engine.start()
    gateway.fail_with = [Unavailable("timed out confirming")]
    with pytest.raises(Unavailable):
        await engine.apply(changes(pub("m9", 3, 1)))
    moved = pub("m7", 2, 1)  # changed by hand meanwhile, as m8's removal
    gateway.held[moved.key] = moved.route
    del gateway.held[MapKey("prod", "m8")]
    gateway.renders = 0
    done = await engine.reconcile()  # the write was in doubt: the read-back is the snapshot
    assert gateway.renders == 1  # m7's new route; the 99 others are kept as rendered
    assert engine.confirmed[moved.key] == moved.route and MapKey("prod", "m8") not in engine.confirmed
    assert {MapKey("prod", "m7"), MapKey("prod", "m8"), MapKey("prod", "m9")} <= done.released


async def test_rendering_a_write_of_many_maps_gives_the_event_loop_back_between_slices():
    # Issue 29: the first pass rendered 10,000 maps in one turn of the event loop.
    gateway = CountingGateway()
    engine, _ = memory_engine(gateway)
    await engine.start()
    async with loop_turns() as turns:
        await engine.apply(changes(*(pub(f"m{i}", 1, 2) for i in range(5000))))
        assert turns() >= 10, f"rendering 5,000 maps let other tasks run {turns()} times"
    assert len(gateway.held) == 5000 and gateway.renders == 5000
