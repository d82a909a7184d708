"""NGINX Lua mode's confirmed table (adapters.nginx.lua_table), pure: the batches it makes, the
checksum each must bring, what NGINX's answer confirms, and what a restart or a broken table gets."""

from __future__ import annotations

import json

import pytest

from adapters.nginx.lua_render import LuaRenderer, checksum, entry_text
from adapters.nginx.lua_table import ConfirmedTable, TableRead, read_table
from publisher.core.values import Backend, MapKey, Route

A, B, C = MapKey("ns", "a"), MapKey("ns", "b"), MapKey("other", "c")


def part(key: MapKey, *weights: int):  # type: ignore[no-untyped-def]
    route = Route(f"{key.name}.example.com", tuple(Backend(f"w{i}", f"http://10.0.0.{i + 1}:8000", w) for i, w in enumerate(weights)))
    return LuaRenderer().render(key, route)


def text(key: MapKey, *weights: int) -> str:
    p = part(key, *weights)
    return entry_text(p, {b.name: (b.name,) for b in p.backends})


def listing(entries: dict[MapKey, str]) -> str:
    return "".join(f"{key} {text}\n" for key, text in entries.items())


def confirmed(entries: dict[MapKey, str], *, boot: str = "boot-1", version: int = 3) -> ConfirmedTable:
    table = ConfirmedTable()
    read = read_table(listing(entries))
    assert read.matches(checksum(entries))
    table.adopt(boot, version, read)
    return table


def answer(batch, version: int):  # type: ignore[no-untyped-def]
    return {"boot": batch.boot, "version": version, "checksum": batch.checksum}


def test_a_read_table_lists_entries_parts_addresses_and_the_checksum():
    entries = {A: text(A, 1, 2), C: text(C, 3)}
    read = read_table(listing(entries))
    assert read.entries == entries
    assert read.parts == {A: part(A, 1, 2), C: part(C, 3)}
    assert read.addresses == {"10.0.0.1": ("10.0.0.1",), "10.0.0.2": ("10.0.0.2",)}
    assert read.matches(checksum(entries)) and not read.matches(checksum({A: entries[A]}))
    assert read_table("").matches(checksum({}))


@pytest.mark.parametrize(
    "line", [f"{A} not json", f"{A} {json.dumps({'h': 'x'})}", f"{A} {json.dumps({'h': 'x', 'r': False, 'b': [[1]]})}"]
)
def test_an_entry_the_sidecar_did_not_write_does_not_read(line: str):
    with pytest.raises(ValueError):
        read_table(line)


def test_a_batch_brings_the_checksum_of_the_whole_table_it_leaves():
    table = confirmed({A: text(A, 1, 2), B: text(B, 5)})
    batch = table.batch({A: text(A, 2, 2), C: text(C, 1)}, {A: part(A, 2, 2), C: part(C, 1)}, [B])
    assert batch.boot == "boot-1" and not batch.replace and batch.maps == 3
    assert batch.checksum == checksum({A: text(A, 2, 2), C: text(C, 1)})
    assert table.confirm(batch, answer(batch, 4))
    assert dict(table.entries) == {A: text(A, 2, 2), C: text(C, 1)} and set(table.parts) == {A, C}
    assert table.checksum == batch.checksum and table.version == 4 and table.boot == table.entries_boot == "boot-1"


def test_the_batch_body_is_what_ome_table_parse_batch_reads():
    table = confirmed({A: text(A, 1), B: text(B, 1)})
    batch = table.batch({A: text(A, 2)}, {A: part(A, 2)}, [B])
    head, *changes = batch.body().split("\n")
    assert json.loads(head) == {"expect_boot": "boot-1", "replace": False}
    assert changes == [f"set ns/a {text(A, 2)}", "delete ns/b"]


def test_changes_leave_out_what_the_table_holds_and_deletes_only_held_maps():
    table = confirmed({A: text(A, 1), B: text(B, 1)})
    entry_of = lambda p: entry_text(p, {b.name: (b.name,) for b in p.backends})  # noqa: E731
    assert table.changes({A: part(A, 1), C: None}, entry_of) is None
    batch = table.changes({A: part(A, 1), B: part(B, 7), C: None, MapKey("ns", "gone"): None}, entry_of)
    assert batch is not None and dict(batch.sets) == {B: text(B, 7)} and list(batch.deletes) == []
    batch = table.changes({A: None}, entry_of)
    assert batch is not None and list(batch.deletes) == [A] and not batch.sets


@pytest.mark.parametrize(
    "wrong",
    [{"boot": "boot-2"}, {"version": 3}, {"version": 2}, {"checksum": "0000000000000"}],
    ids=["another boot", "same version", "older version", "other checksum"],
)
def test_an_answer_that_does_not_confirm_the_batch_leaves_the_table_and_forgets_the_boot(wrong: dict[str, object]):
    entries = {A: text(A, 1)}
    table = confirmed(entries)
    batch = table.batch({B: text(B, 1)}, {B: part(B, 1)}, [])
    assert not table.confirm(batch, {**answer(batch, 4), **wrong})
    assert table.boot is None, "what NGINX holds is unknown: read it back next"
    assert dict(table.entries) == entries and table.entries_boot == "boot-1" and table.version == 3


def test_a_restart_gets_the_whole_confirmed_table_under_the_new_boot_from_version_one():
    entries = {A: text(A, 1, 2), B: text(B, 3)}
    table = confirmed(entries, version=40)
    batch = table.restore("boot-2")
    assert batch.replace and batch.boot == "boot-2" and dict(batch.sets) == entries and not batch.deletes
    assert set(batch.parts) == {A, B} and batch.checksum == checksum(entries) == table.checksum
    assert json.loads(batch.body().split("\n")[0]) == {"expect_boot": "boot-2", "replace": True}
    assert table.confirm(batch, answer(batch, 1)), "a new boot counts its versions from the start"
    assert table.boot == "boot-2" and table.version == 1 and dict(table.entries) == entries


def test_a_restore_batch_stays_what_was_sent_while_the_table_changes():
    table = confirmed({A: text(A, 1)})
    restore = table.restore("boot-2")
    change = table.batch({B: text(B, 1)}, {B: part(B, 1)}, [])
    assert table.confirm(change, answer(change, 4))
    assert set(restore.sets) == {A}


def test_a_broken_table_is_repaired_from_what_was_confirmed_under_its_boot_else_from_what_it_holds():
    ours = {A: text(A, 1)}
    held = read_table(listing({A: text(A, 9), C: text(C, 1)}))
    table = confirmed(ours)
    table.forget_boot()
    batch = table.repair("boot-1", held)
    assert batch.replace and dict(batch.sets) == ours and batch.checksum == checksum(ours)
    batch = table.repair("boot-2", held)
    assert dict(batch.sets) == held.entries and batch.boot == "boot-2" and batch.checksum == checksum(held.entries)
    assert ConfirmedTable().repair("boot-1", held).sets == held.entries


def test_holds_asks_for_the_confirmed_version_and_checksum():
    table = confirmed({A: text(A, 1)}, version=7)
    assert table.holds({"version": 7, "checksum": table.checksum})
    assert not table.holds({"version": 8, "checksum": table.checksum})
    assert not table.holds({"version": 7, "checksum": "0000000000000"})


def test_using_finds_the_maps_with_a_backend_of_those_names():
    table = confirmed({A: text(A, 1, 1), B: text(B, 1), C: text(C, 1, 1, 1)})
    assert set(table.using(frozenset({"10.0.0.2"}))) == {A, C}
    assert set(table.using(frozenset({"10.0.0.1"}))) == {A, B, C}
    assert table.using(frozenset({"elsewhere"})) == {}


def test_an_empty_table_reads_as_a_new_one():
    read = TableRead({}, {}, {}, {}, 0)
    table = ConfirmedTable()
    assert table.boot is None and table.entries_boot is None and table.checksum == checksum({}) and read.matches(table.checksum)


def test_a_part_the_sidecar_rendered_reads_back_as_its_route_without_building_one():
    """A resync's read-back built a Route and its Backends for each of 10,000 maps a minute: a
    part the sidecar rendered now gives back the Route it came from; one read from NGINX builds
    an equal one."""
    route = Route("a.example.com", (Backend("w0", "http://10.0.0.1:8000", 3), Backend("w1", "http://10.0.0.2:8000", 1)))
    rendered = LuaRenderer().render(A, route)
    assert rendered.route() is route
    read = read_table(listing({A: text(A, 3, 1)})).parts[A]
    assert read == rendered and read.route() == route and read.route() is not route
