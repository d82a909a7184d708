from __future__ import annotations

import json

import pytest

from adapters.base import Rejected
from adapters.json_file import JsonAdapter, JsonOptions
from publisher.model import Backend, MapKey, Publication


def pub(name: str, *weights: int) -> Publication:
    return Publication("prod", name, f"{name}.example.com", 2, 6,
                       tuple(Backend(f"worker-{i}", f"http://{name}.worker-{i}.example.com", w) for i, w in enumerate(weights)))


async def test_writes_sorted_publications_and_reads_them_back(tmp_path):
    path = tmp_path / "out.json"
    adapter = JsonAdapter(JsonOptions(json_path=path))
    assert await adapter.current() == {}
    desired = {p.key: p for p in (pub("zeta", 1), pub("alpha", 2, 3))}
    result = await adapter.apply(desired, frozenset(desired))
    assert result.wrote
    document = json.loads(path.read_text())
    assert [p["name"] for p in document["publications"]] == ["alpha", "zeta"]
    assert document["publications"][0] == {
        "namespace": "prod", "name": "alpha", "hostname": "alpha.example.com", "generation": 2, "observedISVCGeneration": 6,
        "backends": [{"cluster": "worker-0", "endpoint": "http://alpha.worker-0.example.com", "weight": 2},
                     {"cluster": "worker-1", "endpoint": "http://alpha.worker-1.example.com", "weight": 3}],
    }
    restarted = JsonAdapter(JsonOptions(json_path=path))
    assert await restarted.current() == desired


async def test_unchanged_content_is_not_rewritten(tmp_path):
    path = tmp_path / "out.json"
    adapter = JsonAdapter(JsonOptions(json_path=path))
    await adapter.current()
    desired = {pub("a", 1).key: pub("a", 1)}
    await adapter.apply(desired, frozenset(desired))
    inode = path.stat().st_ino
    restarted = JsonAdapter(JsonOptions(json_path=path))
    await restarted.current()
    assert not (await restarted.apply(desired, frozenset(desired))).wrote
    assert path.stat().st_ino == inode


async def test_withdrawn_key_leaves_the_file(tmp_path):
    path = tmp_path / "out.json"
    adapter = JsonAdapter(JsonOptions(json_path=path))
    await adapter.current()
    desired = {p.key: p for p in (pub("a", 1), pub("b", 1))}
    await adapter.apply(desired, frozenset(desired))
    await adapter.apply({pub("a", 1).key: pub("a", 1)}, frozenset({MapKey("prod", "b")}))
    assert [p["name"] for p in json.loads(path.read_text())["publications"]] == ["a"]


async def test_a_file_that_is_not_ours_is_refused(tmp_path):
    path = tmp_path / "out.json"
    path.write_text('{"something": "else"}')
    with pytest.raises(Rejected):
        await JsonAdapter(JsonOptions(json_path=path)).current()
