"""publisher.core.model as the gates see it: the malformed-map corpus is InvalidMap with the field named;
unknown and missing optional fields are tolerated."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from publisher.core.gate import GateOptions, decide
from publisher.core.addresses import is_canonical_ipv4, is_hostname, parse_endpoint
from publisher.core.model import InvalidObject, TrafficMap, parse_traffic_map
from publisher.core.values import Reason
from tests.builders import make_condition, make_entry, make_map

A = "worker-a"


def entries_with(**fields: Any) -> list[dict[str, Any]]:
    """worker-a valid, worker-b with `fields` overriding its valid defaults."""
    return [make_entry(A, weight=1), make_entry("worker-b", **{"weight": 1, **fields})]


CORPUS = [
    pytest.param(entries_with(weight=-1), "spec.entries[worker-b].weight", "-1", id="weight-negative"),
    pytest.param(entries_with(weight=1_000_001), "spec.entries[worker-b].weight", "1000001", id="weight-over-cap"),
    pytest.param(entries_with(weight="3"), "spec.entries[worker-b].weight", "'3'", id="weight-string"),
    pytest.param(entries_with(healthy="true"), "spec.entries[worker-b].healthy", "'true'", id="healthy-string"),
    pytest.param([make_entry(A), make_entry(A)], "entries", "duplicate cluster 'worker-a'", id="duplicate-cluster"),
    pytest.param(
        [make_entry("a;b", endpoint="http://x.example.com")], "spec.entries[0].cluster", "'a;b'", id="cluster-semicolon"
    ),
    pytest.param(entries_with(endpoint="ftp://x"), "spec.entries[worker-b].endpoint", "ftp://x", id="endpoint-ftp"),
    pytest.param(
        entries_with(endpoint="http://user@x"), "spec.entries[worker-b].endpoint", "user@x", id="endpoint-userinfo"
    ),
    pytest.param(
        entries_with(endpoint="http://x\n.example.com"), "spec.entries[worker-b].endpoint", "\\n", id="endpoint-newline"
    ),
    pytest.param(
        entries_with(endpoint="http://x .example.com"), "spec.entries[worker-b].endpoint", "x .example", id="endpoint-space"
    ),
    pytest.param(entries_with(factor="abc"), "spec.entries[worker-b].capacity.factor", "'abc'", id="factor-abc"),
    pytest.param(entries_with(factor="1.5.5"), "spec.entries[worker-b].capacity.factor", "'1.5.5'", id="factor-1.5.5"),
    pytest.param(entries_with(factor=3), "spec.entries[worker-b].capacity.factor", "3", id="factor-number"),
    pytest.param(entries_with(drainRefs="d1"), "spec.entries[worker-b].drainRefs", "", id="drain-refs-not-a-list"),
]


@pytest.mark.parametrize(("entries", "field", "value"), CORPUS)
def test_malformed_maps_are_invalid_map_naming_the_field(entries, field, value) -> None:
    item = parse_traffic_map(make_map(entries=entries))
    held = decide(item, None, GateOptions())
    assert held is not None and held.reason is Reason.INVALID_MAP
    assert field in held.message
    assert value in held.message


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        pytest.param({"metadata": {"generation": "3"}}, "metadata.generation", id="generation-string"),
        pytest.param({"spec": {"observedISVCGeneration": None}}, "spec.observedISVCGeneration", id="missing-required"),
        pytest.param({"spec": {"entries": {"a": 1}}}, "spec.entries", id="entries-not-a-list"),
        pytest.param({"status": {"sourceUID": 7}}, "status.sourceUID", id="source-uid-number"),
        pytest.param({"status": {"conditions": [{"type": "Routable", "status": "Yes"}]}}, "status.conditions[0].status",
                     id="condition-status"),
    ],
)
def test_wrong_types_name_the_field(overrides: dict[str, Any], field: str) -> None:
    item = parse_traffic_map(make_map(**overrides))
    held = decide(item, None, GateOptions())
    assert held is not None and held.reason is Reason.INVALID_MAP and field in held.message


def test_unknown_fields_are_tolerated() -> None:
    raw = make_map(
        spec={"futureField": {"x": 1}},
        status={"published": [{"gateway": "g"}], "publisher": {"claims": []}},
        entries=[make_entry(A, weight=1, probe={"result": "Passing", "gated": False, "newThing": 1}, extra=True)],
    )
    assert isinstance(parse_traffic_map(raw), TrafficMap)


def test_missing_optional_fields_are_tolerated() -> None:
    raw = {
        "apiVersion": "ome.io/v1beta1",
        "kind": "TrafficMap",
        "metadata": {"name": "old", "namespace": "prod"},
        "spec": {
            "service": "old",
            "observedISVCGeneration": 1,
            "entries": [{"cluster": A, "endpoint": "https://old.example.com:8443/v1", "weight": 0, "healthy": False}],
        },
    }
    tm = parse_traffic_map(raw)
    assert isinstance(tm, TrafficMap)
    assert tm.spec.entries[0].capacity.allocated == 0 and tm.spec.entries[0].probe is None
    assert tm.status.conditions == []


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        pytest.param(make_entry("worker-b", endpoint="http://x.example.com\n"), "spec.entries[worker-b].endpoint", id="endpoint"),
        pytest.param(make_entry("worker-b\n", endpoint="http://x.example.com"), "spec.entries[1].cluster", id="cluster"),
    ],
)
def test_a_trailing_newline_is_invalid_map(entry: dict[str, Any], field: str) -> None:
    item = parse_traffic_map(make_map(entries=[make_entry(A, weight=1), entry]))
    held = decide(item, None, GateOptions())
    assert held is not None and held.reason is Reason.INVALID_MAP and field in held.message


@pytest.mark.parametrize(
    "url",
    [
        "http://[1]:8080",  # any bracketed hex used to pass as IPv6
        "http://[1:2:3]:8080",
        "http://4294967295",  # a resolver may read these as 255.255.255.255 ...
        "http://010.0.0.1",  # ... and 8.0.0.1
        "http://0x7f.1",
        "http://" + "a" * 70 + ".example.com",  # a label of 70 characters
        "http://" + ".".join(["abcdefghi"] * 250),  # a host of 2,499 characters
    ],
)
def test_endpoint_hosts_that_could_be_read_two_ways_are_refused(url):
    """Issue 11, finding 7: these passed the endpoint check before."""
    with pytest.raises(ValueError):
        parse_endpoint(url)


@pytest.mark.parametrize("url", ["http://[::1]:8080", "http://10.0.0.1:80", "https://chat.worker-a.example.com:8443/v1"])
def test_plain_endpoint_hosts_still_pass(url):
    assert parse_endpoint(url).host


@pytest.mark.parametrize("host, ok", [("chat.example.com", True), ("*.example.com", True), ("10.1.2.3", False),
                                      ("a" * 64 + ".example.com", False), ("x." * 130 + "com", False)])
def test_hostnames_are_dns_names_within_limits(host, ok):
    assert is_hostname(host) is ok


@given(st.lists(st.one_of(st.integers(0, 300), st.from_regex(r"0[0-9]{1,2}", fullmatch=True)), min_size=3, max_size=5))
def test_the_ipv4_fast_path_agrees_with_ipaddress(octets: list[int | str]) -> None:
    host = ".".join(str(octet) for octet in octets)
    try:
        canonical = str(ipaddress.IPv4Address(host)) == host
    except ValueError:
        canonical = False
    assert is_canonical_ipv4(host) == canonical


def test_an_endpoint_is_parsed_once_however_often_it_is_checked(monkeypatch):
    """A merge moved parse_endpoint's cache onto its neighbour: every map's endpoints were parsed
    again at each check and render (104,000 parses instead of 40,000 in a json-dir run of 10,000
    maps, 0.7 s more of the sidecar's CPU)."""
    from publisher.core import addresses

    checked = []
    real = addresses._endpoint_host_problem
    monkeypatch.setattr(addresses, "_endpoint_host_problem", lambda host: checked.append(host) or real(host))
    url = "http://parsed-once.worker-a.example.com:8080"
    for _ in range(3):
        assert addresses.parse_endpoint(url).port == 8080
    assert checked == ["parsed-once.worker-a.example.com"]


def test_a_status_change_is_parsed_as_the_whole_map_is_but_keeps_the_held_spec():
    from publisher.core.model import parse_status_change

    raw = make_map(generation=3)
    held = parse_traffic_map(raw)
    ours = make_condition("gateway-publisher.ome.io/eu", observed_generation=3)
    echo = {**raw, "metadata": {**raw["metadata"], "resourceVersion": "9"},
            "status": {**raw["status"], "conditions": [*raw["status"]["conditions"], ours]}}
    item = parse_status_change(held, echo)
    assert item == parse_traffic_map(echo) and item.spec is held.spec
    # What the whole map's parse refuses, the status change's refuses alike.
    broken = {**echo, "status": {**echo["status"], "conditions": [{**ours, "status": "Maybe"}]}}
    assert isinstance(parse_status_change(held, broken), InvalidObject)
    assert parse_status_change(held, broken) == parse_traffic_map(broken)
    # An invalid map held is parsed again in full.
    invalid = parse_traffic_map({**raw, "spec": {**raw["spec"], "entries": [{"cluster": "Bad Name"}]}})
    assert parse_status_change(invalid, echo) == parse_traffic_map(echo)


def test_a_status_change_keeps_the_held_conditions_it_did_not_change():
    """An echo's unchanged conditions are the held map's own objects: what an echo keeps is one
    more object for every full collection to walk (10,000 echoes at a start)."""
    from publisher.core.model import parse_status_change

    raw = make_map(generation=3)
    ours = make_condition("gateway-publisher.ome.io/eu", observed_generation=2)
    raw = {**raw, "status": {**raw["status"], "conditions": [*raw["status"]["conditions"], ours]}}
    held = parse_traffic_map(raw)
    rewritten = {**ours, "observedGeneration": 3, "message": "generation 3"}
    echo = {**raw, "metadata": {**raw["metadata"], "resourceVersion": "9"},
            "status": {**raw["status"], "conditions": [*raw["status"]["conditions"][:-1], rewritten]}}
    item = parse_status_change(held, echo)
    assert item == parse_traffic_map(echo)
    *others, mine = item.status.conditions
    assert others and all(new is old for new, old in zip(others, held.status.conditions))
    assert mine.observed_generation == 3 and mine is not held.status.conditions[-1]
