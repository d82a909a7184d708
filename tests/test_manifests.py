"""publisher.source.manifests: YAML/JSON text to raw objects, in input order, with errors naming the input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from publisher.source.manifests import ManifestError, parse_manifests, read_manifests

LIST = """\
apiVersion: v1
kind: List
metadata:
  resourceVersion: ""
items:
  - kind: InferenceService
    metadata: {name: a}
  - kind: TrafficMap
    metadata: {name: a}
"""


def test_one_yaml_object() -> None:
    assert parse_manifests("f.yaml", "kind: TrafficMap\nmetadata:\n  name: a\n") == [
        {"kind": "TrafficMap", "metadata": {"name": "a"}}
    ]


def test_several_documents_in_order_skipping_empty_ones() -> None:
    text = "---\nkind: A\n---\n# only a comment\n---\nkind: B\n---\n"
    assert parse_manifests("f.yaml", text) == [{"kind": "A"}, {"kind": "B"}]


def test_a_kubectl_list_is_spliced_in_place() -> None:
    text = "kind: First\n---\n" + LIST + "---\nkind: Last\n"
    assert [obj["kind"] for obj in parse_manifests("f.yaml", text)] == ["First", "InferenceService", "TrafficMap", "Last"]


def test_an_empty_list() -> None:
    assert parse_manifests("f.yaml", "kind: List\nitems: []\n") == []


def test_json_object_and_json_list() -> None:
    obj = {"kind": "TrafficMap", "metadata": {"name": "a"}, "spec": {"entries": [{"weight": 1}]}}
    assert parse_manifests("f.json", json.dumps(obj, indent="\t")) == [obj]
    assert parse_manifests("f.json", json.dumps({"kind": "List", "items": [obj, obj]})) == [obj, obj]


def test_yaml_flow_mapping_that_is_not_json() -> None:
    assert parse_manifests("f.yaml", "{kind: A, n: 1}") == [{"kind": "A", "n": 1}]


def test_timestamps_stay_strings_as_kubernetes_reads_them() -> None:
    [obj] = parse_manifests("f.yaml", "lastTransitionTime: 2025-01-01T00:00:00Z\nday: 2025-01-01\n")
    assert obj == {"lastTransitionTime": "2025-01-01T00:00:00Z", "day": "2025-01-01"}


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        pytest.param("kind: A\nspec: [1, 2\n", 3, "flow sequence", id="unclosed-flow"),
        pytest.param("kind: A\nmetadata:\n  name: a\n b: 2\n", 4, "", id="bad-indent"),
        pytest.param('{"kind": "A",\n "x": [1}\n', 2, "", id="bad-json"),
        pytest.param("- 1\n- 2\n", None, "document 1 is a list, not an object", id="not-an-object"),
        pytest.param("kind: A\n---\nplain string\n", None, "document 2 is a str", id="second-not-an-object"),
        pytest.param("kind: List\nitems: [1]\n", None, "document 1: List items must be objects", id="list-item-scalar"),
        pytest.param("kind: List\nitems: {a: 1}\n", None, "List items must be objects", id="list-items-mapping"),
    ],
)
def test_errors_name_the_input_and_line(text: str, line: int | None, problem: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifests("maps.yaml", text)
    assert caught.value.source == "maps.yaml" and caught.value.line == line
    assert str(caught.value).startswith("maps.yaml:" if line is None else f"maps.yaml:{line}:")
    assert problem in str(caught.value)


def test_read_manifests_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "maps.yaml"
    path.write_text(LIST, encoding="utf-8")
    assert len(read_manifests(path)) == 2


@pytest.mark.parametrize(
    ("content", "problem"),
    [pytest.param(None, "cannot read", id="missing"), pytest.param(b"\xff\xfe\x00", "cannot read", id="not-utf8")],
)
def test_read_manifests_errors_name_the_file(tmp_path: Path, content: bytes | None, problem: str) -> None:
    path = tmp_path / "maps.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ManifestError, match=problem) as caught:
        read_manifests(path)
    assert caught.value.source == str(path)


# --- input no manifest needs: refused before anything walks it ---------------------------------------


def _nested(levels: int) -> str:
    return "{\"a\": " * levels + "1" + "}" * levels


def test_nesting_up_to_the_limit_is_read_and_beyond_it_refused():
    from publisher.source.manifests import MAX_DEPTH

    assert parse_manifests("ok.json", _nested(MAX_DEPTH))
    with pytest.raises(ManifestError, match=f"deep.json: nested deeper than {MAX_DEPTH} levels"):
        parse_manifests("deep.json", _nested(MAX_DEPTH + 1))


def test_yaml_aliases_that_expand_past_the_limit_or_into_themselves_are_refused():
    laughs = "a: &a [" + ",".join(["x"] * 10) + "]\n"
    for name in "bcdefgh":
        previous = chr(ord(name) - 1)
        laughs += f"{name}: &{name} [" + ",".join([f"*{previous}"] * 10) + "]\n"
    with pytest.raises(ManifestError, match="more than 10,000,000 values once YAML aliases are expanded"):
        parse_manifests("laughs.yaml", laughs)
    with pytest.raises(ManifestError, match="a YAML alias refers to a value that contains it"):
        parse_manifests("loop.yaml", "a: &a [*a]\n")
    shared = parse_manifests("shared.yaml", "a: &a {k: v}\nb: *a\nc: [*a, *a]\n")  # a DAG is fine
    assert shared == [{"a": {"k": "v"}, "b": {"k": "v"}, "c": [{"k": "v"}, {"k": "v"}]}]


def test_a_file_larger_than_the_limit_is_refused_without_being_parsed(tmp_path, monkeypatch):
    from publisher.source import manifests

    monkeypatch.setattr(manifests, "MAX_BYTES", 1024)
    path = tmp_path / "big.yaml"
    path.write_text("kind: TrafficMap\n" + "# padding\n" * 200)
    with pytest.raises(ManifestError, match="big.yaml: larger than"):
        read_manifests(path)
