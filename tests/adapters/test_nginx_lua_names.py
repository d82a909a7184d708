"""NGINX Lua mode's name cache (adapters.nginx.lua_names), pure: which names are looked up when,
what a failed lookup keeps (fail static) and rejects, and what is forgotten."""

from __future__ import annotations

import pytest

from adapters.nginx.lua_names import NameCache, ip_literal, rejected_maps
from adapters.nginx.lua_render import LuaRenderer
from publisher.core.values import Backend, MapKey, Route

A, B = MapKey("ns", "a"), MapKey("ns", "b")


def part(key: MapKey, *endpoints: str):  # type: ignore[no-untyped-def]
    route = Route(f"{key.name}.example.com", tuple(Backend(f"w{i}", endpoint, 1) for i, endpoint in enumerate(endpoints)))
    return LuaRenderer().render(key, route)


def test_ip_literals_are_their_own_address():
    assert ip_literal("10.0.0.1") == ("10.0.0.1",)
    assert ip_literal("::1") == ("::1",)
    assert ip_literal("model.example.com") is None


def test_unknown_stale_and_forced_names_are_due_once_each_sorted_and_never_an_ip_literal():
    cache = NameCache(30.0)
    parts = [part(A, "http://b.test:80", "https://a.test", "http://10.0.0.1:80"), None, part(B, "http://b.test:8080", "http://[::1]:80")]
    assert cache.due(parts, 0.0) == [("a.test", 443), ("b.test", 8080)]
    cache.settle([("a.test", 443), ("b.test", 8080)], [("10.1.0.1",), ("10.1.0.2",)], 0.0)
    assert cache.due(parts, 30.0) == [], "resolved within the interval"
    assert cache.due(parts, 30.5) == [("a.test", 443), ("b.test", 8080)], "older than the interval"
    assert cache.due(parts, 1.0, force=frozenset({"b.test", "10.0.0.1"})) == [("b.test", 8080)]


def test_a_failed_lookup_keeps_a_known_names_addresses_and_rejects_only_new_names():
    cache = NameCache(30.0)
    cache.settle([("known.test", 80)], [("10.1.0.1",)], 0.0)
    looked_up = [("known.test", 80), ("new.test", 80), ("fine.test", 80)]
    failed = cache.settle(looked_up, [OSError("timed out"), OSError("no address"), ("10.1.0.3",)], 40.0)
    assert failed == {"new.test": "cannot resolve new.test: no address"}
    assert cache.addresses("known.test") == ("10.1.0.1",) and cache.addresses("fine.test") == ("10.1.0.3",)
    assert cache.due([part(A, "http://known.test", "http://fine.test")], 41.0) == [("known.test", 80)], "still due: it failed"
    assert cache.settle([("x" * 64 + ".test", 80)], [UnicodeError("label too long")], 41.0) == {
        "x" * 64 + ".test": f"cannot resolve {'x' * 64}.test: label too long"
    }


def test_an_error_that_is_not_a_failed_lookup_is_raised():
    with pytest.raises(RuntimeError):
        NameCache().settle([("a.test", 80)], [RuntimeError("a bug")], 0.0)


def test_addresses_of_a_literal_need_no_lookup_and_of_an_unknown_name_are_missing():
    cache = NameCache()
    assert cache.addresses("10.0.0.9") == ("10.0.0.9",)
    with pytest.raises(KeyError):
        cache.addresses("never.test")


def test_addresses_read_back_from_nginx_seed_only_unknown_names():
    cache = NameCache(30.0)
    cache.settle([("a.test", 80)], [("10.1.0.1",)], 10.0)
    cache.seed({"a.test": ("10.9.9.9",), "b.test": ("10.1.0.2",), "10.0.0.1": ("10.0.0.1",)}, 20.0)
    assert cache.addresses("a.test") == ("10.1.0.1",) and cache.addresses("b.test") == ("10.1.0.2",)
    assert cache.stale(40.5) == frozenset({"a.test"}), "each counts from when it was learnt; a literal is never kept"


def test_refreshed_names_wait_another_interval_and_unused_ones_are_forgotten():
    cache = NameCache(30.0)
    cache.settle([("a.test", 80), ("b.test", 80)], [("10.1.0.1",), ("10.1.0.2",)], 0.0)
    assert cache.stale(31.0) == frozenset({"a.test", "b.test"})
    cache.refreshed({"a.test"}, 31.0)
    assert cache.stale(32.0) == frozenset({"b.test"})
    cache.forget({"b.test", "never.test"})
    assert cache.stale(100.0) == frozenset({"a.test"})
    with pytest.raises(KeyError):
        cache.addresses("b.test")


def test_a_map_is_rejected_with_its_first_failed_name():
    changes = {
        A: part(A, "http://ok.test", "http://bad.test", "http://worse.test"),
        B: part(B, "http://ok.test"),
        MapKey("ns", "gone"): None,
    }
    failed = {"worse.test": "cannot resolve worse.test", "bad.test": "cannot resolve bad.test"}
    assert rejected_maps(changes, failed) == {A: "cannot resolve bad.test"}
    assert rejected_maps(changes, {}) == {}
