"""The engine's hostname bookkeeping on its own: seniority, duplicates read back, the rounds of
claims a write is cut into, swap cycles and the HostConflict hold."""

from __future__ import annotations

from adapters.hostnames import Hostnames, conflict
from publisher.core.values import Backend, Held, MapKey, Reason, Route

A, B, C = MapKey("prod", "a"), MapKey("prod", "b"), MapKey("prod", "c")


def route(host: str) -> Route:
    return Route(f"{host}.example.com", (Backend("w0", f"http://{host}.w0.example.com", 1),))


def test_the_conflict_hold_names_the_hostname_and_its_owner():
    assert conflict("x.example.com", A) == Held(
        Reason.HOST_CONFLICT, "hostname x.example.com is already served for prod/a; this map is published once prod/a lets it go")


def test_seniority_is_the_older_map_then_namespace_name_then_maps_never_seen():
    hostnames = Hostnames()
    hostnames.record_created(B, "2026-01-01T00:00:00Z")
    hostnames.record_created(C, "2026-01-01T00:00:00Z")
    hostnames.rebuild({A: route("x"), B: route("x"), C: route("x")})
    assert hostnames.owner("x.example.com") == B  # A was never seen; B and C tie on age, B sorts first
    hostnames.record_created(A, "2025-01-01T00:00:00Z")
    hostnames.rebuild({A: route("x"), B: route("x"), C: route("x")})
    assert hostnames.owner("x.example.com") == A


def test_a_duplicate_read_back_keeps_its_senior_map_and_withdraws_the_others():
    hostnames = Hostnames()
    hostnames.record_created(A, "2025-01-01T00:00:00Z")
    hostnames.record_created(B, "2026-01-01T00:00:00Z")
    routes = {A: route("x"), B: route("x"), C: route("y")}
    hostnames.rebuild(routes)
    wanted: dict[MapKey, Route | None] = {}
    rejected: dict[MapKey, Held] = {}
    hostnames.settle_duplicates(wanted, routes, rejected)
    assert wanted == {B: None}
    assert rejected == {B: conflict("x.example.com", A)}
    assert hostnames.waiting() == {B: "x.example.com"}


def test_a_junior_map_leaving_a_duplicated_hostname_is_not_held():
    hostnames = Hostnames()
    hostnames.record_created(A, "2025-01-01T00:00:00Z")
    routes = {A: route("x"), B: route("x")}
    hostnames.rebuild(routes)
    wanted: dict[MapKey, Route | None] = {B: route("z")}
    rejected: dict[MapKey, Held] = {}
    hostnames.settle_duplicates(wanted, routes, rejected)
    assert wanted == {B: route("z")} and rejected == {} and hostnames.waiting() == {}


def test_a_claim_on_a_free_hostname_goes_to_the_senior_claimant():
    hostnames = Hostnames()
    hostnames.record_created(A, "2026-01-02T00:00:00Z")
    hostnames.record_created(B, "2026-01-01T00:00:00Z")
    rejected: dict[MapKey, Held] = {}
    ready, later, broken = hostnames.next_round({A: route("x"), B: route("x")}, {}, rejected, may_break=True)
    assert ready == {B: route("x")} and later == {} and broken is None
    assert rejected == {A: conflict("x.example.com", B)}
    assert hostnames.waiting() == {A: "x.example.com"}


def test_a_claim_on_a_hostname_whose_owner_is_moving_waits_for_the_owners_write():
    hostnames = Hostnames()
    routes = {A: route("x")}
    hostnames.rebuild(routes)
    rejected: dict[MapKey, Held] = {}
    ready, later, broken = hostnames.next_round({A: route("y"), B: route("x")}, routes, rejected, may_break=True)
    assert ready == {A: route("y")} and later == {B: route("x")} and broken is None and rejected == {}
    hostnames.commit(A, routes[A], route("y"))
    ready, later, broken = hostnames.next_round(later, {A: route("y")}, rejected, may_break=True)
    assert ready == {B: route("x")} and later == {} and rejected == {}


def test_a_claim_on_a_hostname_whose_owner_stays_is_held():
    hostnames = Hostnames()
    routes = {A: route("x")}
    hostnames.rebuild(routes)
    rejected: dict[MapKey, Held] = {}
    ready, later, _ = hostnames.next_round({B: route("x")}, routes, rejected, may_break=True)
    assert ready == {} and later == {}
    assert rejected == {B: conflict("x.example.com", A)}


def test_a_swap_is_broken_once_by_withdrawing_the_youngest_owner():
    hostnames = Hostnames()
    hostnames.record_created(A, "2025-01-01T00:00:00Z")
    hostnames.record_created(B, "2026-01-01T00:00:00Z")
    routes = {A: route("x"), B: route("y")}
    hostnames.rebuild(routes)
    swap: dict[MapKey, Route | None] = {A: route("y"), B: route("x")}
    rejected: dict[MapKey, Held] = {}
    ready, later, broken = hostnames.next_round(swap, routes, rejected, may_break=True)
    assert ready == {B: None} and later == swap and broken == B and rejected == {}
    # The withdrawal refused: the next pass may not break again, so the claims wait as conflicts.
    ready, later, broken = hostnames.next_round(swap, routes, rejected, may_break=False)
    assert ready == {} and later == {} and broken is None
    assert rejected == {A: conflict("y.example.com", B), B: conflict("x.example.com", A)}
    assert hostnames.unbroken_cycles(None) == {A, B}
    assert hostnames.unbroken_cycles(B) == set()


def test_release_hands_back_the_maps_whose_hostname_is_free_and_those_of_an_unbroken_cycle():
    hostnames = Hostnames()
    routes = {A: route("x")}
    hostnames.rebuild(routes)
    rejected: dict[MapKey, Held] = {}
    hostnames.next_round({B: route("x"), C: route("x")}, routes, rejected, may_break=True)
    assert hostnames.waiting() == {B: "x.example.com", C: "x.example.com"}
    assert hostnames.release({}, None) == set()  # A still serves x
    hostnames.commit(A, routes[A], None)
    assert hostnames.owner("x.example.com") is None
    assert hostnames.release({C: conflict("x.example.com", A)}, None) == {B}  # C is held now
    assert hostnames.waiting() == {C: "x.example.com"}


def test_a_committed_move_off_a_duplicated_hostname_leaves_it_to_the_next_senior_map():
    hostnames = Hostnames()
    hostnames.record_created(A, "2025-01-01T00:00:00Z")
    hostnames.record_created(B, "2026-01-01T00:00:00Z")
    hostnames.record_created(C, "2027-01-01T00:00:00Z")
    routes = {A: route("x"), B: route("x"), C: route("x")}
    hostnames.rebuild(routes)
    hostnames.commit(A, routes[A], route("z"))
    assert hostnames.owner("x.example.com") == B and hostnames.owner("z.example.com") == A
    # x is still served for B and C: the next apply settles it as a duplicate.
    wanted: dict[MapKey, Route | None] = {}
    rejected: dict[MapKey, Held] = {}
    hostnames.settle_duplicates(wanted, routes, rejected)
    assert wanted == {C: None}
    hostnames.commit(C, routes[C], None)
    wanted.clear()
    hostnames.settle_duplicates(wanted, routes, rejected)
    assert wanted == {}  # no longer a duplicate
