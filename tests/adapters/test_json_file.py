from __future__ import annotations

import asyncio
import json

import pytest

from adapters import ADAPTERS
from adapters.json import JsonOptions
from adapters.json.render import map_file
from adapters.json.transport import INDEX_FILE
from publisher.core.values import Backend, MapKey, Publication, Reason


def pub(name: str, *weights: int, generation: int = 2, host: str | None = None) -> Publication:
    return Publication("prod", name, host or f"{name}.example.com", generation, 6,
                       tuple(Backend(f"worker-{i}", f"http://{name}.worker-{i}.example.com", w) for i, w in enumerate(weights)))


def engine(tmp_path, mode: str):
    options = JsonOptions(json_path=tmp_path / "out.json") if mode == "file" else JsonOptions(json_dir=tmp_path)
    return ADAPTERS["json"].engine("json", options)


def served_names(tmp_path, mode: str) -> list[str]:
    if mode == "file":
        return [p["name"] for p in json.loads((tmp_path / "out.json").read_text())["publications"]]
    return sorted(json.loads(p.read_text())["name"] for p in tmp_path.glob("prod_*.json"))


MODES = ["file", "dir"]


@pytest.mark.parametrize("mode", MODES)
async def test_writes_routes_and_reads_them_back(tmp_path, mode):
    adapter = engine(tmp_path, mode)
    assert await adapter.start() == {}
    pubs = [pub("zeta", 1), pub("alpha", 2, 3)]
    result = await adapter.apply({p.key: p for p in pubs})
    assert result.wrote and not result.rejected
    assert served_names(tmp_path, mode) == ["alpha", "zeta"]
    restarted = engine(tmp_path, mode)
    assert dict(await restarted.start()) == {p.key: p.route for p in pubs}


def test_file_holds_routes_without_generations(tmp_path):
    document_entry = json.loads(ADAPTERS["json"].engine("json", JsonOptions(json_path=tmp_path / "x"))._renderer.render(
        MapKey("prod", "alpha"), pub("alpha", 2, 3).route))
    assert document_entry == {
        "namespace": "prod", "name": "alpha", "hostname": "alpha.example.com",
        "backends": [{"cluster": "worker-0", "endpoint": "http://alpha.worker-0.example.com", "weight": 2},
                     {"cluster": "worker-1", "endpoint": "http://alpha.worker-1.example.com", "weight": 3}],
    }


@pytest.mark.parametrize("mode", MODES)
async def test_withdrawn_key_leaves_the_gateway(tmp_path, mode):
    adapter = engine(tmp_path, mode)
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub("a", 1), pub("b", 1))})
    await adapter.apply({MapKey("prod", "b"): None})
    assert served_names(tmp_path, mode) == ["a"]


def test_options_need_exactly_one_target(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        JsonOptions()
    with pytest.raises(ValueError, match="exactly one"):
        JsonOptions(json_path=tmp_path / "a", json_dir=tmp_path)


async def test_directory_mode_touches_only_the_changed_map(tmp_path):
    """Finding 12: one change among many writes one map's file and the small index, nothing else."""
    adapter = engine(tmp_path, "dir")
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub(f"m{i}", 1, 2) for i in range(50))})
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("prod_*.json")}
    inodes = {p.name: p.stat().st_ino for p in tmp_path.glob("prod_*.json")}
    await adapter.apply({MapKey("prod", "m7"): pub("m7", 3, 1)})
    after_inodes = {p.name: p.stat().st_ino for p in tmp_path.glob("prod_*.json")}
    assert {name for name in inodes if inodes[name] != after_inodes[name]} == {map_file(MapKey("prod", "m7"))}
    assert len(before) == 50
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index == {"version": 2, "maps": 50}


@pytest.mark.parametrize("mode", MODES)
async def test_a_hostname_that_could_change_config_structure_is_refused(tmp_path, mode):
    """Finding 6: the JSON adapter used to publish any hostname as it was."""
    adapter = engine(tmp_path, mode)
    bad = pub("chat", 1, host="chat.example.com\n location /x { return 200 pwned; }")
    held = adapter.check(bad)
    assert held is not None and held.reason == Reason.INVALID_PLAN


@pytest.mark.parametrize("mode", MODES)
async def test_deleted_output_is_written_back_on_reconcile(tmp_path, mode):
    """Finding 8: with the output deleted, resync used to find no drift to repair."""
    adapter = engine(tmp_path, mode)
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub("a", 1), pub("b", 2))})
    for path in [tmp_path / "out.json"] if mode == "file" else list(tmp_path.glob("prod_*.json")):
        path.unlink()
    assert (await adapter.reconcile()).repaired == {MapKey("prod", "a"), MapKey("prod", "b")}
    assert served_names(tmp_path, mode) == ["a", "b"]
    assert (await adapter.reconcile()).repaired == frozenset()


@pytest.mark.parametrize("mode", MODES)
async def test_corrupted_output_serves_nothing_and_heals(tmp_path, mode):
    """Finding 8: a corrupted file used to fail every read-back until some map changed."""
    adapter = engine(tmp_path, mode)
    await adapter.start()
    await adapter.apply({pub("a", 1).key: pub("a", 1)})
    target = tmp_path / ("out.json" if mode == "file" else map_file(MapKey("prod", "a")))
    target.write_text("{not json")
    assert await engine(tmp_path, mode).start() == {}
    assert (await adapter.reconcile()).repaired == {MapKey("prod", "a")}
    assert served_names(tmp_path, mode) == ["a"]


async def test_a_map_whose_file_name_the_filesystem_cannot_hold_is_invalid_up_front(tmp_path):
    """Issue 21, finding 12: a name over the filesystem's limit failed every --json-dir write
    (Unavailable, for every map) instead of being held."""
    too_long, longest = (Publication("prod", "m" * length, f"m{length}.example.com", 1, 1, (Backend("a", "http://a.example.com", 1),))
                         for length in (241, 240))
    held = engine(tmp_path, "dir").check(too_long)
    assert held is not None and held.reason == Reason.INVALID_PLAN and "file name" in held.message
    assert engine(tmp_path, "file").check(too_long) is None
    adapter = engine(tmp_path, "dir")
    assert adapter.check(longest) is None
    await adapter.start()
    assert not (await adapter.apply({longest.key: longest})).rejected
    assert served_names(tmp_path, "dir") == ["m" * 240]


def _index(tmp_path) -> dict:
    return json.loads((tmp_path / INDEX_FILE).read_text())


@pytest.mark.parametrize("damage", ["deleted", "not-json", "wrong-count"])
async def test_a_damaged_index_is_repaired_by_resync_and_its_version_moves_on(tmp_path, damage):
    """Issue 21, finding 11: a deleted or corrupted index.json stayed so until some map changed."""
    adapter = engine(tmp_path, "dir")
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub("a", 1), pub("b", 2))})
    before = _index(tmp_path)
    if damage == "deleted":
        (tmp_path / INDEX_FILE).unlink()
    else:
        (tmp_path / INDEX_FILE).write_text("{not json" if damage == "not-json" else json.dumps({**before, "maps": 7}))
    assert (await adapter.reconcile()).repaired == frozenset()
    repaired = _index(tmp_path)
    assert repaired["maps"] == 2 and repaired["version"] > before["version"]
    await adapter.apply({MapKey("prod", "c"): pub("c", 1)})
    assert _index(tmp_path)["version"] > repaired["version"] and _index(tmp_path)["maps"] == 3


async def test_the_index_version_never_goes_backwards_across_a_restart_that_lost_the_index(tmp_path):
    """Issue 21, finding 11: after a restart without index.json the version started again at 1."""
    adapter = engine(tmp_path, "dir")
    await adapter.start()
    for weight in range(1, 6):
        await adapter.apply({MapKey("prod", "a"): pub("a", weight)})
    before = _index(tmp_path)["version"]
    (tmp_path / INDEX_FILE).unlink()
    restarted = engine(tmp_path, "dir")
    await restarted.start()
    assert _index(tmp_path) == {"version": _index(tmp_path)["version"], "maps": 1} and _index(tmp_path)["version"] > before
    started = _index(tmp_path)["version"]
    await restarted.apply({MapKey("prod", "a"): pub("a", 9)})
    assert _index(tmp_path)["version"] == started + 1
    # An index that parses but went back (restored from a backup): the counter still goes on.
    (tmp_path / INDEX_FILE).write_text(json.dumps({"version": 1, "maps": 1}))
    await restarted.reconcile()
    assert _index(tmp_path)["version"] > started + 1


async def test_directory_mode_reads_back_only_the_files_that_changed_since_its_last_read(tmp_path, monkeypatch):
    """A resync read back and parsed every map's file (10,000: about a second holding the applier
    and the interpreter's lock). A file whose inode, size and times are those of the last read is
    not parsed again; one changed since, or within the racy window of a timestamp tick, is."""
    import os

    from adapters.json import transport as module

    adapter = engine(tmp_path, "dir")
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub(f"m{i}", 1, 2) for i in range(20))})
    an_hour_ago = (1_700_000_000_000_000_000, 1_700_000_000_000_000_000)
    for path in tmp_path.glob("prod_*.json"):
        os.utime(path, ns=an_hour_ago)
    parsed: list[str] = []
    real = module.from_json
    monkeypatch.setattr(module, "from_json", lambda data: parsed.append(data["name"]) or real(data))
    reader = module.JsonDirTransport(tmp_path)
    first = await reader.read()
    assert len(first) == 20 and len(parsed) == 20  # ctimes are recent: every file is parsed again
    await asyncio.sleep(0)
    monkeypatch.setattr(module, "RACY_NS", 0)  # as if the window had passed
    assert await reader.read() == first and len(parsed) == 40
    again = await reader.read()
    assert len(parsed) == 40 and all(again[key] is route for key, route in (await reader.read()).items())
    # Rewritten in place, the same size, its mtime put back: its ctime moved, so it is read.
    m7 = tmp_path / map_file(MapKey("prod", "m7"))
    text = m7.read_text()
    m7.write_text(text.replace('"weight":1', '"weight":3'))
    os.utime(m7, ns=an_hour_ago)
    changed = await reader.read()
    assert parsed[40:] == ["m7"] and [b.weight for b in changed[MapKey("prod", "m7")].backends] == [3, 2]
    m7.unlink()
    assert MapKey("prod", "m7") not in await reader.read()


async def test_directory_mode_reads_back_what_it_wrote_without_parsing_it(tmp_path, monkeypatch):
    """The first resync after a first publish parsed every file (10,000: half a second holding
    the applier). A file holding exactly the bytes the transport wrote serves the Route they were
    rendered from; one changed since is parsed."""
    from adapters.json import transport as module
    from adapters.json.render import JsonRenderer

    renderer, writer = JsonRenderer(per_map_files=True), module.JsonDirTransport(tmp_path)
    routes = {p.key: p.route for p in (pub(f"m{i}", 1, 2) for i in range(10))}
    parts = {key: renderer.render(key, route) for key, route in routes.items()}
    await writer.read()
    await writer.write(parts, parts)
    parsed: list[str] = []
    real = module.from_json
    monkeypatch.setattr(module, "from_json", lambda data: parsed.append(data["name"]) or real(data))
    m3 = MapKey("prod", "m3")
    (tmp_path / map_file(m3)).write_bytes(renderer.render(m3, pub("m3", 5, 2).route) + b"\n")  # someone else's write
    read = await writer.read()
    assert parsed == ["m3"] and [b.weight for b in read[m3].backends] == [5, 2]
    assert all(read[key] is route for key, route in routes.items() if key != m3)


async def test_directory_mode_reads_a_page_of_maps_and_what_else_the_directory_serves(tmp_path, monkeypatch):
    """Issue 29: a resync read every file in one go, holding the applier (200-450 ms at 10,000
    maps, changes waiting behind it). A page reads the files of its maps alone; the last page
    also lists the directory for maps the engine does not hold, and checks the index."""
    import os

    from adapters.json import transport as module

    adapter = engine(tmp_path, "dir")
    await adapter.start()
    await adapter.apply({p.key: p for p in (pub(f"m{i}", 1, 2) for i in range(6))})
    monkeypatch.setattr(module, "RACY_NS", 0)
    reader = module.JsonDirTransport(tmp_path)
    await reader.read()
    opened: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(module.os, "stat", lambda path, *a, **k: opened.append(os.path.basename(path)) or real_stat(path, *a, **k))
    m1, m2, stray = MapKey("prod", "m1"), MapKey("prod", "m2"), MapKey("prod", "stray")
    (tmp_path / map_file(m2)).unlink()
    page = await reader.read_page([m1, m2])
    assert sorted(opened) == [map_file(m1), map_file(m2)]
    assert set(page) == {m1} and [b.weight for b in page[m1].backends] == [1, 2]
    (tmp_path / map_file(stray)).write_text(json.dumps({"namespace": "prod", "name": "stray", "hostname": "stray.example.com",
                                                         "backends": [{"cluster": "w", "endpoint": "http://w.example.com", "weight": 1}]}))
    (tmp_path / INDEX_FILE).unlink()
    others = await reader.read_others([MapKey("prod", f"m{i}") for i in range(6)])
    assert list(others) == [stray]
    assert _index(tmp_path)["maps"] == 6  # five maps' files and the stray one


async def test_a_paged_reconcile_repairs_its_page_and_the_last_page_what_else_is_served(tmp_path):
    adapter = engine(tmp_path, "dir")
    await adapter.start()
    assert adapter.reads_in_pages
    await adapter.apply({p.key: p for p in (pub(f"m{i}", 1) for i in range(4))})
    m0, m3 = MapKey("prod", "m0"), MapKey("prod", "m3")
    for key in (m0, m3):
        (tmp_path / map_file(key)).unlink()
    stray = tmp_path / map_file(MapKey("prod", "stray"))
    stray.write_bytes((tmp_path / map_file(MapKey("prod", "m1"))).read_bytes().replace(b'"m1"', b'"stray"'))
    first = await adapter.reconcile_page([m0, MapKey("prod", "m1")], last=False)
    assert first.repaired == {m0} and not (tmp_path / map_file(m3)).exists() and stray.exists()
    last = await adapter.reconcile_page([MapKey("prod", "m2"), m3], last=True)
    assert last.repaired == {m3, MapKey("prod", "stray")}
    assert served_names(tmp_path, "dir") == ["m0", "m1", "m2", "m3"]
