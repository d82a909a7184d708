"""adapters/nginx/reload.py: pure render/read-back, the transport under the engine against a fake NGINX,
and real NGINX (slow)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import ADAPTERS, Engine
from adapters.base import ApplyResult, Rejected, Unavailable, WriteResult
from adapters.nginx import NginxOptions, build
from adapters.nginx.reload import NginxFileTransport
from adapters.nginx.reload_render import (
    SPLIT_UNITS,
    NginxRenderer,
    read_back,
    render,
    route_problem,
    split_units,
    version_of,
)
from publisher.core.model import InvalidObject, parse_traffic_map
from publisher.core.values import MapKey, Publication, Reason
from tests.adapters.nginx_fixtures import make_pub, routes, running_nginx
from tests.gateways import Backends, assert_measured_split, eventually, measure

INJECTION = "a; } server { listen 9999; }"


def _file(*pubs: Publication, **options: object) -> str:
    return render(routes(*pubs), **options)  # type: ignore[arg-type]


# --- Pure: render and read back -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pub", "rewrite_host", "expected", "absent"),
    [
        pytest.param(
            make_pub("m", ("a", "http://10.0.0.1:8000", 3), ("b", "http://10.0.0.2", 1)),
            False,
            ["server 10.0.0.1:8000 weight=3;", "server 10.0.0.2:80 weight=1;", "proxy_pass http://ome_ns_m;",
             "proxy_set_header Host $host;", "server_name m.example.com;"],
            ["return 503"],
            id="weights-3-1-host-passes-through",
        ),
        pytest.param(
            make_pub("m", ("a", "http://10.0.0.1", 1), ("b", "http://10.0.0.2", 0)),
            False,
            ["server 10.0.0.2:80 down;"],
            ["weight=0"],
            id="weight-0-listed-down",
        ),
        pytest.param(
            make_pub("m", ("a", "https://a.example.net", 1)),
            False,
            ["proxy_pass https://ome_ns_m;", "server a.example.net:443 weight=1;", "proxy_ssl_server_name on;"],
            [],
            id="https-over-tls",
        ),
        pytest.param(
            make_pub("m", ("a", "http://10.0.0.1", 0), ("b", "http://10.0.0.2", 0)),
            False,
            ["return 503;", "server_name m.example.com;"],
            ["upstream", "server 10.0.0.1"],
            id="all-zero-503",
        ),
        pytest.param(make_pub("m"), False, ["return 503;"], ["upstream"], id="empty-503"),
        pytest.param(
            make_pub("m", ("a", "http://a.example.net", 1), ("b", "https://b.example.net:8443", 3),
                     ("c", "http://c.example.net", 0)),
            True,
            ["25.00% 0;", "75.00% 1;", "1 https://ome_ns_m_1;", "1 b.example.net;", "2 c.example.net;",
             "server c.example.net:80 down;", "proxy_ssl_name $ome_"],
            ["% 2;", "proxy_set_header Host $host;"],
            id="rewrite-host-split-clients",
        ),
    ],
)
def test_render_shapes(pub: Publication, rewrite_host: bool, expected: list[str], absent: list[str]) -> None:
    text = _file(pub, rewrite_host=rewrite_host)
    for snippet in expected:
        assert snippet in text
    for snippet in absent:
        assert snippet not in text


def test_unknown_hostnames_get_a_default_404_server() -> None:
    text = render({}, listen="127.0.0.1:9000")
    assert "listen 127.0.0.1:9000 default_server;\n    server_name _;\n    return 404;" in text


@pytest.mark.parametrize("rewrite_host", [False, True], ids=["pass-host", "rewrite-host"])
def test_read_back_returns_what_was_rendered(rewrite_host: bool) -> None:
    pubs = [
        make_pub("m", ("a", "http://10.0.0.1", 3), ("b", "http://10.0.0.2", 0), generation=7,
                 observed_isvc_generation=4),
        make_pub("z.dotted", hostname="*.z.example.com"),
    ]
    routes_back, problems = read_back(_file(*pubs, rewrite_host=rewrite_host))
    assert problems == []
    assert routes_back == routes(*pubs)


def test_read_back_takes_a_file_written_with_publications_in_it() -> None:
    legacy = (
        '# ome-publication {"backends":[{"cluster":"a","endpoint":"http://10.0.0.1","weight":3}],'
        '"generation":4,"hostname":"m.example.com","name":"m","namespace":"ns","observedISVCGeneration":2}\n'
    )
    assert read_back(legacy) == (routes(make_pub("m", ("a", "http://10.0.0.1", 3))), [])


def test_version_follows_content_only() -> None:
    one = _file(make_pub("m", ("a", "http://10.0.0.1", 1)))
    assert version_of(one) == version_of(_file(make_pub("m", ("a", "http://10.0.0.1", 1))))
    assert version_of(one) != version_of(_file(make_pub("m", ("a", "http://10.0.0.1", 2))))
    assert f'return 200 "{version_of(one)}\\n";' in one


def test_a_generation_only_change_renders_the_same_part() -> None:
    """Finding 3: generations are provenance, not gateway text."""
    renderer = NginxRenderer(listen="127.0.0.1:8080")
    old = make_pub("m", ("a", "http://10.0.0.1", 1), generation=3, observed_isvc_generation=2)
    new = dataclasses.replace(old, generation=4, observed_isvc_generation=3)
    assert renderer.render(new.key, new.route) == renderer.render(old.key, old.route)
    assert "generation" not in renderer.render(new.key, new.route).text.lower()


# No deadline: on a machine shared by parallel workers one example can take longer than 200 ms.
@settings(deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1_000_000), min_size=1, max_size=40))
def test_split_units_stay_within_a_hundredth_of_a_percent(weights: list[int]) -> None:
    units = split_units(weights)
    total = sum(weights)
    if total == 0:
        assert units == [0] * len(weights)
        return
    assert sum(units) == SPLIT_UNITS
    for weight, unit in zip(weights, units):
        assert abs(Fraction(unit, SPLIT_UNITS) - Fraction(weight, total)) < Fraction(1, SPLIT_UNITS)
        if weight == 0:
            assert unit == 0


def test_a_file_with_two_maps_on_one_server_name_is_never_rendered() -> None:
    """Finding 4 (defence beside the engine's hostname ownership): NGINX would only warn."""
    first = make_pub("first", ("a", "http://10.0.0.1", 1), hostname="chat.example.com")
    second = make_pub("second", ("a", "http://10.0.0.2", 1), hostname="chat.example.com")
    with pytest.raises(ValueError, match="both claim server_name chat.example.com"):
        _file(first, second)


# --- Pure: nothing from a map can inject NGINX syntax ----------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "endpoint", "field"),
    [
        pytest.param(INJECTION, "http://10.0.0.1", "entries[0].cluster", id="cluster"),
        pytest.param("a", f"http://{INJECTION}", "entries[0].endpoint", id="endpoint"),
        pytest.param("a", "http://10.0.0.1/x;}", "entries[0].endpoint", id="endpoint-path"),
    ],
)
def test_injection_in_a_traffic_map_is_an_invalid_map(cluster: str, endpoint: str, field: str) -> None:
    def raw(cluster: str, endpoint: str) -> dict[str, object]:
        entry = {"cluster": cluster, "endpoint": endpoint, "weight": 1, "healthy": True}
        return {
            "metadata": {"name": "m", "namespace": "ns", "generation": 1},
            "spec": {"service": "m", "observedISVCGeneration": 1, "entries": [entry]},
        }

    assert not isinstance(parse_traffic_map(raw("a", "http://10.0.0.1")), InvalidObject)
    parsed = parse_traffic_map(raw(cluster, endpoint))
    assert isinstance(parsed, InvalidObject)
    assert field in parsed.message


@pytest.mark.parametrize(
    "pub",
    [
        pytest.param(make_pub("m", (INJECTION, "http://10.0.0.1", 1)), id="cluster"),
        pytest.param(make_pub("m", ("a", f"http://{INJECTION}", 1)), id="endpoint"),
        pytest.param(make_pub("m", ("a", "http://10.0.0.1:80/x;y", 1)), id="endpoint-path"),
        pytest.param(make_pub("m", hostname=f"h.example.com; {INJECTION}"), id="hostname"),
        pytest.param(make_pub(INJECTION), id="name"),
        pytest.param(make_pub("m", namespace="ns;"), id="namespace"),
        pytest.param(make_pub("m", ("a", "http://10.0.0.1", -1)), id="weight"),
    ],
)
async def test_injection_in_a_publication_never_reaches_the_file(tmp_path: Path, pub: Publication) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    held = adapter.check(pub)
    assert held is not None and held.reason == Reason.INVALID_PLAN
    with pytest.raises(ValueError):
        _file(pub)
    with pytest.raises(ValueError):
        NginxRenderer().render(pub.key, pub.route)
    await adapter.start()
    # Past a check the loop would have made: the renderer still refuses, as an internal error.
    result = await adapter.apply({pub.key: pub})
    assert result.rejected[pub.key].reason == Reason.INTERNAL_ERROR
    assert not result.wrote
    assert (tmp_path / "ome.conf").read_text() == render({})
    assert gateway.reloads == 0


def test_mixed_schemes_need_rewrite_host(tmp_path: Path) -> None:
    pub = make_pub("m", ("a", "http://10.0.0.1", 1), ("b", "https://10.0.0.2", 1))
    assert ADAPTERS["nginx"].engine("nginx", _options(tmp_path)).check(pub) is not None
    assert ADAPTERS["nginx"].engine("nginx", _options(tmp_path, rewrite_host=True)).check(pub) is None
    renderer, _ = build(_options(tmp_path))
    assert renderer.problem(pub.key, pub.route) is not None


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="no-reload-way"),
        pytest.param({"nginx_pid_file": "/p", "nginx_reload_cmd": "nginx -s reload"}, id="two-reload-ways"),
        pytest.param({"nginx_pid_file": "/p", "nginx_listen": "80; include /etc/passwd"}, id="listen-syntax"),
        pytest.param({"nginx_pid_file": "/p", "nginx_listen": "1:8081", "nginx_status_listen": "1:8081"}, id="same"),
    ],
)
def test_options_refuse(fields: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        NginxOptions(nginx_conf_file=Path("/f"), **fields)


# --- The transport, alone and under the engine, against a fake NGINX ---------------------------------


@dataclass
class FakeNginx:
    """Loads the file on reload unless it names a refused host; serves the loaded file's version
    (None: not running)."""

    conf: Path
    refused_hosts: set[str] = field(default_factory=set)
    ignore_reloads: bool = False
    reloads: int = 0
    tests: int = 0
    serving: str | None = None

    def _error(self) -> str | None:
        text = self.conf.read_text()
        for host in self.refused_hosts:
            if f"server {host}:" in text:
                return f'[emerg] host not found in upstream "{host}:80" in {self.conf}'
        return None

    async def test(self) -> str | None:
        self.tests += 1
        return self._error()

    async def reload(self) -> str | None:
        self.reloads += 1
        if not self.ignore_reloads and self._error() is None:
            self.serving = version_of(self.conf.read_text())
        return None

    async def served_version(self) -> str | None:
        return self.serving

    async def aclose(self) -> None:
        return None


@dataclass
class FakeClock:
    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _options(tmp_path: Path, **overrides: object) -> NginxOptions:
    fields: dict[str, object] = {"nginx_conf_file": tmp_path / "ome.conf", "nginx_pid_file": tmp_path / "pid"}
    fields.update(overrides)
    return NginxOptions(**fields)  # type: ignore[arg-type]


def _fake_adapter(
    tmp_path: Path, gateway: FakeNginx | None = None, **overrides: object
) -> tuple[Engine, FakeNginx, FakeClock]:
    gateway, clock = gateway or FakeNginx(tmp_path / "ome.conf"), FakeClock()
    options = _options(tmp_path, **overrides)
    transport = NginxFileTransport(options, gateway=gateway, clock=clock, sleep=clock.sleep, confirm_timeout=1.0, confirm_for=0)
    return Engine("nginx", build(options)[0], transport), gateway, clock


def _engine(options: NginxOptions, **transport: float) -> Engine:
    return Engine("nginx", build(options)[0], NginxFileTransport(options, **transport))  # type: ignore[arg-type]


def _changes(desired: dict[MapKey, Publication], changed: frozenset[MapKey]) -> dict[MapKey, Publication | None]:
    return {key: desired.get(key) for key in changed}


def _fake_transport(tmp_path: Path, gateway: FakeNginx, **overrides: object) -> NginxFileTransport:
    clock = FakeClock()
    options = _options(tmp_path, **overrides)
    return NginxFileTransport(options, gateway=gateway, clock=clock, sleep=clock.sleep, confirm_timeout=1.0, confirm_for=0)


def _parts(*pubs: Publication) -> dict:
    renderer = NginxRenderer()
    return {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}


def _state(*pubs: Publication) -> dict[MapKey, Publication]:
    return {pub.key: pub for pub in pubs}


async def test_read_writes_a_valid_empty_file_when_there_is_none(tmp_path: Path) -> None:
    adapter, _, _ = _fake_adapter(tmp_path)
    assert await adapter.start() == {}
    assert (tmp_path / "ome.conf").read_text() == render({})


async def test_unchanged_content_is_neither_written_nor_reloaded(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.start()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 1)))
    first = await adapter.apply(_changes(desired, frozenset(desired)))
    second = await adapter.apply(_changes(desired, frozenset(desired)))
    assert (first.wrote, first.reloads) == (True, 1)
    assert second == ApplyResult()
    assert gateway.reloads == 1


async def test_a_generation_only_change_writes_nothing(tmp_path: Path) -> None:
    """Finding 3: on the old code the generation was in the file, so this reloaded NGINX."""
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.start()
    old = make_pub("m", ("a", "http://10.0.0.1", 1), generation=1)
    await adapter.apply(_changes(_state(old), frozenset({old.key})))
    text = (tmp_path / "ome.conf").read_text()
    new = dataclasses.replace(old, generation=2, observed_isvc_generation=2)
    assert await adapter.apply(_changes(_state(new), frozenset({new.key}))) == ApplyResult()
    assert gateway.reloads == 1
    assert (tmp_path / "ome.conf").read_text() == text
    assert dict(adapter.confirmed) == routes(new)


async def test_a_restarted_adapter_reads_back_and_writes_nothing(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.start()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 2)), make_pub("n", ("b", "https://b.example.net", 0)))
    await adapter.apply(_changes(desired, frozenset(desired)))
    running = FakeNginx(tmp_path / "ome.conf", serving=gateway.serving)
    restarted, regateway, _ = _fake_adapter(tmp_path, running)
    assert dict(await restarted.start()) == routes(*desired.values())
    assert await restarted.apply(desired) == ApplyResult()
    assert regateway.reloads == 0


async def test_reloads_wait_for_the_min_interval(tmp_path: Path) -> None:
    adapter, gateway, clock = _fake_adapter(tmp_path, nginx_min_reload_interval=2.0)
    await adapter.start()
    await adapter.apply(_changes(_state(make_pub("m", ("a", "http://10.0.0.1", 1))), frozenset({MapKey("ns", "m")})))
    assert clock.sleeps == []
    clock.now += 0.5
    await adapter.apply(_changes(_state(make_pub("m", ("a", "http://10.0.0.1", 2))), frozenset({MapKey("ns", "m")})))
    assert clock.sleeps == [1.5]
    clock.now += 5
    await adapter.apply(_changes(_state(make_pub("m", ("a", "http://10.0.0.1", 3))), frozenset({MapKey("ns", "m")})))
    assert clock.sleeps == [1.5] and gateway.reloads == 3


async def test_a_refused_test_raises_rejected_and_keeps_the_confirmed_file(tmp_path: Path) -> None:
    gateway = FakeNginx(tmp_path / "ome.conf")
    transport = _fake_transport(tmp_path, gateway, nginx_test_cmd="nginx -t")
    await transport.read()
    good = [make_pub(f"ok{i}", ("a", f"http://10.0.0.{i}", 1)) for i in range(5)]
    await transport.write(_parts(*good), _parts(*good))
    good_text = (tmp_path / "ome.conf").read_text()
    gateway.refused_hosts = {"nowhere.invalid"}
    bad = make_pub("bad", ("a", "http://nowhere.invalid", 1))
    with pytest.raises(Rejected, match="host not found in upstream"):
        await transport.write(_parts(*good, bad), _parts(bad))
    assert (tmp_path / "ome.conf").read_text() == good_text
    assert gateway.serving == version_of(good_text) and gateway.reloads == 1
    # The engine isolates by writing subsets: without the refused map, the rest goes through.
    more = make_pub("ok9", ("a", "http://10.0.0.9", 1))
    assert (await transport.write(_parts(*good, more), _parts(more))).reloads == 1
    assert read_back((tmp_path / "ome.conf").read_text())[0] == routes(*good, more)


async def test_two_parts_with_one_server_name_are_rejected_before_anything_is_written(tmp_path: Path) -> None:
    """Finding 4: on the old code both server blocks went into the file and both maps Published.
    The engine holds the second claim (HostConflict); the transport refuses such a file on its own."""
    gateway = FakeNginx(tmp_path / "ome.conf")
    adapter, _, _ = _fake_adapter(tmp_path, gateway)
    await adapter.start()
    first = make_pub("first", ("a", "http://10.0.0.1", 1), hostname="chat.example.com")
    await adapter.apply({first.key: first})
    text = (tmp_path / "ome.conf").read_text()
    second = make_pub("second", ("a", "http://10.0.0.2", 1), hostname="chat.example.com")
    result = await adapter.apply({second.key: second})
    assert result.rejected[second.key].reason == Reason.HOST_CONFLICT
    with pytest.raises(Rejected, match="both claim server_name chat.example.com"):
        await adapter.transport.write(_parts(first, second), _parts(second))
    assert (tmp_path / "ome.conf").read_text() == text and gateway.reloads == 1


async def test_an_unconfirmed_reload_restores_the_last_confirmed_file(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.start()
    good = _state(make_pub("m", ("a", "http://10.0.0.1", 1)))
    await adapter.apply(_changes(good, frozenset(good)))
    good_text = (tmp_path / "ome.conf").read_text()
    gateway.refused_hosts = {"nowhere.invalid"}
    bad = _state(make_pub("m", ("a", "http://nowhere.invalid", 1), generation=2))
    result = await adapter.apply(_changes(bad, frozenset(bad)))
    assert result.rejected[MapKey("ns", "m")].reason == Reason.APPLY_FAILED
    assert gateway.reloads == 3  # the good one, the refused one, and the one that put the good file back
    assert (tmp_path / "ome.conf").read_text() == good_text
    assert gateway.serving == version_of(good_text)


async def test_a_refused_file_found_on_disk_is_never_taken_for_what_nginx_serves(tmp_path: Path) -> None:
    """Finding 2, the wedge: a crash between writing a file and its confirmation leaves a file
    NGINX refused. The old adapter read it as its last good config, kept its refused map in
    every file it assembled, and no later apply could succeed, across restarts too."""
    gateway = FakeNginx(tmp_path / "ome.conf")
    adapter, _, _ = _fake_adapter(tmp_path, gateway)
    await adapter.start()
    good = _state(make_pub("m", ("a", "http://10.0.0.1", 1)))
    await adapter.apply(_changes(good, frozenset(good)))
    good_text = (tmp_path / "ome.conf").read_text()
    gateway.refused_hosts = {"nowhere.invalid"}
    refused = _file(*good.values(), make_pub("bad", ("a", "http://nowhere.invalid", 1)))
    (tmp_path / "ome.conf").write_text(refused)  # written, then the sidecar died

    restarted, _, _ = _fake_adapter(tmp_path, FakeNginx(tmp_path / "ome.conf", {"nowhere.invalid"}, serving=gateway.serving))
    assert dict(await restarted.start()) == routes(*good.values())
    assert (tmp_path / "ome.conf").read_text() == good_text
    changed = _state(make_pub("m", ("a", "http://10.0.0.2", 1)))
    result = await restarted.apply(changed)
    assert result.rejected == {} and result.reloads == 1


async def test_a_served_version_no_file_holds_is_not_claimed_and_the_next_write_heals_it(tmp_path: Path) -> None:
    """Finding 2, with no confirmed copy (a file left by the old adapter): nothing proves what
    NGINX serves, so read() claims nothing instead of adopting the refused file, and the engine's
    write of every map it wants replaces it."""
    refused = _file(make_pub("m", ("a", "http://10.0.0.1", 1)), make_pub("bad", ("a", "http://nowhere.invalid", 1)))
    (tmp_path / "ome.conf").write_text(refused)
    gateway = FakeNginx(tmp_path / "ome.conf", {"nowhere.invalid"}, serving="0123456789abcdef")
    adapter, _, _ = _fake_adapter(tmp_path, gateway)
    assert await adapter.start() == {}
    good = make_pub("m", ("a", "http://10.0.0.1", 1))
    result = await adapter.apply({good.key: good})
    assert result.rejected == {} and result.reloads == 1
    assert gateway.serving == version_of((tmp_path / "ome.conf").read_text())
    assert await NginxFileTransport(_options(tmp_path), gateway=gateway).read() == routes(good)


async def test_with_nginx_down_the_new_file_waits_on_disk_for_nginx_to_start(tmp_path: Path) -> None:
    """A pod starting: nothing serves our file yet, so nothing is claimed, and the write that cannot
    reload leaves the desired file for NGINX to start from (never an older, unproven one)."""
    refused = _file(make_pub("bad", ("a", "http://nowhere.invalid", 1)))
    (tmp_path / "ome.conf").write_text(refused)

    @dataclass
    class DownNginx(FakeNginx):
        async def reload(self) -> str | None:
            raise FileNotFoundError(tmp_path / "pid")

    gateway = DownNginx(tmp_path / "ome.conf", {"nowhere.invalid"})
    adapter, _, _ = _fake_adapter(tmp_path, gateway)
    assert await adapter.start() == {}
    good = make_pub("m", ("a", "http://10.0.0.1", 1))
    with pytest.raises(Unavailable):
        await adapter.apply({good.key: good})
    assert read_back((tmp_path / "ome.conf").read_text())[0] == routes(good)
    gateway.serving = version_of((tmp_path / "ome.conf").read_text())  # NGINX starts from it
    assert await adapter.start() == routes(good)


async def test_withdrawn_maps_leave_the_file(tmp_path: Path) -> None:
    adapter, _, _ = _fake_adapter(tmp_path)
    await adapter.start()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 1)), make_pub("n", ("a", "http://10.0.0.2", 1)))
    await adapter.apply(_changes(desired, frozenset(desired)))
    del desired[MapKey("ns", "m")]
    await adapter.apply(_changes(desired, frozenset({MapKey("ns", "m")})))
    assert read_back((tmp_path / "ome.conf").read_text())[0] == routes(*desired.values())


# --- Real NGINX --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_real_nginx_splits_weights_and_answers_503_and_404(tmp_path: Path) -> None:
    async with Backends(("a", "b", "c", "d", "z")) as backends, running_nginx(tmp_path) as nginx:
        adapter = _engine(nginx.options())
        try:
            await adapter.start()
            desired = _state(
                make_pub("one", ("a", backends.endpoint("a"), 3), ("b", backends.endpoint("b"), 1),
                         ("z", backends.endpoint("z"), 0)),
                make_pub("two", ("c", backends.endpoint("c"), 2), ("d", backends.endpoint("d"), 3)),
                make_pub("zero", ("a", backends.endpoint("a"), 0), ("b", backends.endpoint("b"), 0)),
                make_pub("empty"),
            )
            result = await adapter.apply(_changes(desired, frozenset(desired)))
            assert result.rejected == {} and result.reloads == 1, nginx.errors()
            await assert_measured_split(nginx.url, "one.example.com", {"a": 3, "b": 1, "z": 0}, 1000)
            await assert_measured_split(nginx.url, "two.example.com", {"c": 2, "d": 3}, 1000)
            hits_before = sum(backends.hits.values())
            assert await measure(nginx.url, "zero.example.com", 50) == {"status:503": 50}
            assert await measure(nginx.url, "empty.example.com", 50) == {"status:503": 50}
            assert await measure(nginx.url, "unpublished.example.com", 50) == {"status:404": 50}
            assert sum(backends.hits.values()) == hits_before
            assert backends.host_headers["c"].keys() == {"two.example.com"}
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_rewrite_host_splits_per_backend_upstream(tmp_path: Path) -> None:
    async with Backends(("a", "b", "z")) as backends, running_nginx(tmp_path) as nginx:
        adapter = _engine(nginx.options(rewrite_host=True))
        try:
            await adapter.start()
            desired = _state(
                make_pub("rw", ("a", backends.endpoint("a"), 2), ("b", backends.endpoint("b"), 3),
                         ("z", backends.endpoint("z"), 0))
            )
            result = await adapter.apply(_changes(desired, frozenset(desired)))
            assert result.rejected == {}, nginx.errors()
            # split_clients draws per request: 2000 requests put 5 points at over 4 standard deviations.
            await assert_measured_split(nginx.url, "rw.example.com", {"a": 2, "b": 3, "z": 0}, 2000)
            assert backends.host_headers["a"].keys() == {"127.0.0.1"}
            assert backends.host_headers["b"].keys() == {"127.0.0.1"}
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_a_burst_of_50_changes_costs_at_most_2_reloads(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, running_nginx(tmp_path) as nginx:
        adapter = _engine(nginx.options(nginx_min_reload_interval=2.0))
        key = MapKey("ns", "m")

        def state(i: int) -> dict[MapKey, Publication]:
            # The last change sends everything to a.
            return _state(make_pub("m", ("a", backends.endpoint("a"), i), ("b", backends.endpoint("b"), 50 - i),
                                   generation=i))

        try:
            await adapter.start()
            await adapter.apply(_changes(state(0), frozenset({key})))
            # The burst starts when a reload is allowed at once: the worst case for coalescing.
            await asyncio.sleep(adapter.hold_off() + 0.1)
            latest = {"state": state(0), "version": 0}
            burst_done = asyncio.Event()

            async def produce() -> None:
                for i in range(1, 51):
                    latest["state"], latest["version"] = state(i), i
                    await asyncio.sleep(0.015)
                burst_done.set()

            reloads, applied = 0, 0
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(produce())
                # The loop's way: one apply at a time, after the adapter's hold-off, with the
                # newest state at that moment.
                while not (burst_done.is_set() and applied == latest["version"]):
                    if applied == latest["version"]:
                        await asyncio.sleep(0.005)
                        continue
                    await asyncio.sleep(adapter.hold_off())
                    version = latest["version"]
                    result = await adapter.apply(_changes(latest["state"], frozenset({key})))
                    assert result.rejected == {}
                    reloads += result.reloads
                    applied = version
            assert reloads <= 2
            assert read_back(nginx.conf_file.read_text())[0] == routes(*state(50).values())
            assert await measure(nginx.url, "m.example.com", 100) == {"a": 100}
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_transport_refused_write_keeps_serving_and_a_subset_goes_through(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, running_nginx(tmp_path) as nginx:
        renderer, _ = build(nginx.options())
        transport = NginxFileTransport(
            nginx.options(nginx_pid_file=None, nginx_reload_cmd=nginx.command("-s", "reload"),
                          nginx_test_cmd=nginx.command("-t"), nginx_min_reload_interval=0.2)
        )

        def parts(*pubs: Publication) -> dict:
            return {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}

        try:
            assert await transport.read() == {}
            first = [make_pub("bad", ("a", backends.endpoint("a"), 1)), make_pub("ok", ("a", backends.endpoint("a"), 1))]
            assert (await transport.write(parts(*first), parts(*first))).reloads == 1
            bad = make_pub("bad", ("b", "http://no-such-host.invalid:8000", 1))
            ok = make_pub("ok", ("b", backends.endpoint("b"), 1))
            with pytest.raises(Rejected, match="no-such-host.invalid"):
                await transport.write(parts(bad, ok), parts(bad, ok))
            assert await measure(nginx.url, "ok.example.com", 20) == {"a": 20}
            assert "no-such-host" not in nginx.conf_file.read_text()
            # What the engine's bisection does next: the good half alone.
            assert (await transport.write(parts(first[0], ok), parts(ok))).reloads == 1
            assert await measure(nginx.url, "ok.example.com", 20) == {"b": 20}
            assert await measure(nginx.url, "bad.example.com", 20) == {"a": 20}
        finally:
            await transport.aclose()


@pytest.mark.slow
async def test_real_nginx_keeps_serving_the_old_config_when_a_reload_fails(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, running_nginx(tmp_path) as nginx:
        adapter = _engine(nginx.options(nginx_min_reload_interval=0.2), confirm_timeout=2.0)
        try:
            await adapter.start()
            good = _state(make_pub("m", ("a", backends.endpoint("a"), 1)))
            await adapter.apply(_changes(good, frozenset(good)))
            good_text = nginx.conf_file.read_text()
            bad = _state(make_pub("m", ("a", "http://no-such-host.invalid", 1), generation=2))
            result = await adapter.apply(_changes(bad, frozenset(bad)))
            assert result.rejected[MapKey("ns", "m")].reason == Reason.APPLY_FAILED
            assert nginx.conf_file.read_text() == good_text
            await eventually(lambda: "no-such-host.invalid" in nginx.errors())
            assert await measure(nginx.url, "m.example.com", 20) == {"a": 20}
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_a_restarted_sidecar_reads_back_what_is_served_and_writes_nothing(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, running_nginx(tmp_path) as nginx:
        renderer, transport = build(nginx.options())
        pubs = [make_pub("m", ("a", backends.endpoint("a"), 3), ("b", backends.endpoint("b"), 1)), make_pub("zero")]
        parts = {pub.key: renderer.render(pub.key, pub.route) for pub in pubs}
        try:
            await transport.read()
            assert (await transport.write(parts, parts)).reloads == 1
        finally:
            await transport.aclose()
        text = nginx.conf_file.read_text()
        _, restarted = build(nginx.options())
        try:
            assert await restarted.read() == routes(*pubs)
            assert await restarted.write(parts, {}) == WriteResult()
            assert nginx.conf_file.read_text() == text
            assert await measure(nginx.url, "zero.example.com", 10) == {"status:503": 10}
        finally:
            await restarted.aclose()


@pytest.mark.slow
async def test_real_nginx_wedge_a_refused_file_on_disk_at_start_is_not_adopted(tmp_path: Path) -> None:
    """Finding 2 against a real NGINX: the sidecar died between writing a file NGINX refuses and
    its confirmation. On the old code the restarted adapter took that file as last good, and every
    later apply was refused (the bad map was in every file it assembled, unchanged)."""
    async with Backends(("a", "b")) as backends, running_nginx(tmp_path) as nginx:
        options = nginx.options(nginx_pid_file=None, nginx_reload_cmd=nginx.command("-s", "reload"),
                                nginx_test_cmd=nginx.command("-t"), nginx_min_reload_interval=0.2)
        adapter = _engine(options)
        good = _state(make_pub("m", ("a", backends.endpoint("a"), 1)))
        try:
            await adapter.start()
            assert (await adapter.apply(_changes(good, frozenset(good)))).rejected == {}
        finally:
            await adapter.aclose()
        good_text = nginx.conf_file.read_text()
        refused = make_pub("bad", ("a", "http://no-such-host.invalid", 1))
        nginx.conf_file.write_text(render(routes(*good.values(), refused), listen=options.nginx_listen,
                                          status_listen=options.nginx_status_listen))
        restarted = _engine(options)
        try:
            held = await restarted.start()
            assert dict(held) == routes(*good.values())
            assert nginx.conf_file.read_text() == good_text
            changed = _state(make_pub("m", ("b", backends.endpoint("b"), 1), generation=2))
            result = await restarted.apply(changed)
            assert result.rejected == {} and result.reloads == 1
            assert await measure(nginx.url, "m.example.com", 20) == {"b": 20}
        finally:
            await restarted.aclose()


@pytest.mark.slow
async def test_real_nginx_a_server_name_nginx_would_ignore_is_refused(tmp_path: Path) -> None:
    """Finding 4 beyond our own file: `nginx -t` passes with "conflicting server name ... ignored"
    when another server block already serves the name; the old adapter published such a map."""
    operator_server = "server { listen {listen}; server_name taken.example.com; return 418; }"
    async with Backends(("a",)) as backends, running_nginx(tmp_path, extra_server=operator_server) as nginx:
        adapter = _engine(nginx.options(nginx_test_cmd=nginx.command("-t")))
        try:
            await adapter.start()
            pub = make_pub("m", ("a", backends.endpoint("a"), 1), hostname="taken.example.com")
            result = await adapter.apply(_changes(_state(pub), frozenset({pub.key})))
            assert "conflicting server name" in result.rejected[pub.key].message
            assert await measure(nginx.url, "taken.example.com", 10) == {"status:418": 10}
        finally:
            await adapter.aclose()


@pytest.mark.parametrize("hostname", ["chat.example.com\n", "chat.example.com;", "chat.example.com }"], ids=["newline", "semicolon", "brace"])
def test_a_hostname_that_could_end_a_directive_is_refused(hostname: str) -> None:
    pub = make_pub("m", ("a", "http://127.0.0.1:8000", 1))
    bad = Publication(pub.namespace, pub.name, hostname, pub.generation, pub.observed_isvc_generation, pub.backends)
    assert route_problem(bad.key, bad.route) is not None
