"""adapters/nginx.py: pure render/read-back, the apply logic against a fake NGINX, and real NGINX (slow)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.base import ApplyResult
from adapters.nginx import (
    SPLIT_UNITS,
    NginxAdapter,
    NginxOptions,
    problem,
    read_back,
    render,
    split_units,
    version_of,
)
from publisher.model import InvalidObject, MapKey, Publication, Reason, parse_traffic_map
from tests.adapters.nginx_fixtures import make_pub, running_nginx
from tests.gateways import Backends, assert_measured_split, eventually, measure

INJECTION = "a; } server { listen 9999; }"


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
    text = render([pub], rewrite_host=rewrite_host)
    for snippet in expected:
        assert snippet in text
    for snippet in absent:
        assert snippet not in text


def test_unknown_hostnames_get_a_default_404_server() -> None:
    text = render([], listen="127.0.0.1:9000")
    assert "listen 127.0.0.1:9000 default_server;\n    server_name _;\n    return 404;" in text


@pytest.mark.parametrize("rewrite_host", [False, True], ids=["pass-host", "rewrite-host"])
def test_read_back_returns_what_was_rendered(rewrite_host: bool) -> None:
    pubs = [
        make_pub("m", ("a", "http://10.0.0.1", 3), ("b", "http://10.0.0.2", 0), generation=7,
                 observed_isvc_generation=4),
        make_pub("z.dotted", hostname="*.z.example.com"),
    ]
    pubs_back, problems = read_back(render(pubs, rewrite_host=rewrite_host))
    assert problems == []
    assert pubs_back == {pub.key: pub for pub in pubs}


def test_version_follows_content_only() -> None:
    one = render([make_pub("m", ("a", "http://10.0.0.1", 1))])
    assert version_of(one) == version_of(render([make_pub("m", ("a", "http://10.0.0.1", 1))]))
    assert version_of(one) != version_of(render([make_pub("m", ("a", "http://10.0.0.1", 2))]))
    assert f'return 200 "{version_of(one)}\\n";' in one


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
        render([pub])
    await adapter.current()
    result = await adapter.apply({pub.key: pub}, frozenset({pub.key}))
    assert result.rejected[pub.key].reason == Reason.INVALID_PLAN
    assert not result.wrote
    assert (tmp_path / "ome.conf").read_text() == render([])
    assert gateway.reloads == 0


def test_mixed_schemes_need_rewrite_host(tmp_path: Path) -> None:
    pub = make_pub("m", ("a", "http://10.0.0.1", 1), ("b", "https://10.0.0.2", 1))
    assert NginxAdapter(_options(tmp_path)).check(pub) is not None
    assert NginxAdapter(_options(tmp_path, rewrite_host=True)).check(pub) is None


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


# --- apply() against a fake NGINX -------------------------------------------------------------------


@dataclass
class FakeNginx:
    """Loads the file on reload unless it names a refused host; serves the loaded file's version."""

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


def _fake_adapter(tmp_path: Path, **overrides: object) -> tuple[NginxAdapter, FakeNginx, FakeClock]:
    gateway, clock = FakeNginx(tmp_path / "ome.conf"), FakeClock()
    adapter = NginxAdapter(
        _options(tmp_path, **overrides), gateway=gateway, clock=clock, sleep=clock.sleep, confirm_timeout=1.0
    )
    return adapter, gateway, clock


def _state(*pubs: Publication) -> dict[MapKey, Publication]:
    return {pub.key: pub for pub in pubs}


async def test_current_writes_a_valid_empty_file_when_there_is_none(tmp_path: Path) -> None:
    adapter, _, _ = _fake_adapter(tmp_path)
    assert await adapter.current() == {}
    assert (tmp_path / "ome.conf").read_text() == render([])


async def test_unchanged_content_is_neither_written_nor_reloaded(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.current()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 1)))
    first = await adapter.apply(desired, frozenset(desired))
    second = await adapter.apply(desired, frozenset(desired))
    assert (first.wrote, first.reloads) == (True, 1)
    assert second == ApplyResult()
    assert gateway.reloads == 1


async def test_a_restarted_adapter_reads_back_and_writes_nothing(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.current()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 2)), make_pub("n", ("b", "https://b.example.net", 0)))
    await adapter.apply(desired, frozenset(desired))
    restarted, regateway, _ = _fake_adapter(tmp_path)
    assert await restarted.current() == desired
    assert await restarted.apply(desired, frozenset(desired)) == ApplyResult()
    assert regateway.reloads == 0


async def test_reloads_wait_for_the_min_interval(tmp_path: Path) -> None:
    adapter, gateway, clock = _fake_adapter(tmp_path, nginx_min_reload_interval=2.0)
    await adapter.current()
    await adapter.apply(_state(make_pub("m", ("a", "http://10.0.0.1", 1))), frozenset({MapKey("ns", "m")}))
    assert clock.sleeps == []
    clock.now += 0.5
    await adapter.apply(_state(make_pub("m", ("a", "http://10.0.0.1", 2))), frozenset({MapKey("ns", "m")}))
    assert clock.sleeps == [1.5]
    clock.now += 5
    await adapter.apply(_state(make_pub("m", ("a", "http://10.0.0.1", 3))), frozenset({MapKey("ns", "m")}))
    assert clock.sleeps == [1.5] and gateway.reloads == 3


async def test_a_refused_map_is_isolated_and_keeps_its_last_good_config(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path, nginx_test_cmd="nginx -t")
    await adapter.current()
    old_bad = make_pub("bad", ("a", "http://10.0.0.9", 1))
    await adapter.apply(_state(old_bad), frozenset({old_bad.key}))
    gateway.refused_hosts = {"nowhere.invalid"}
    pubs = [make_pub(f"ok{i}", ("a", f"http://10.0.0.{i}", 1)) for i in range(5)]
    new_bad = make_pub("bad", ("a", "http://nowhere.invalid", 1), generation=2)
    desired = _state(*pubs, new_bad)
    result = await adapter.apply(desired, frozenset(desired))
    assert set(result.rejected) == {new_bad.key}
    assert result.rejected[new_bad.key].reason == Reason.APPLY_FAILED
    assert "host not found in upstream" in result.rejected[new_bad.key].message
    assert result.reloads == 1
    held, _ = read_back((tmp_path / "ome.conf").read_text())
    assert held == _state(*pubs, old_bad)
    assert gateway.serving == version_of((tmp_path / "ome.conf").read_text())


async def test_an_unconfirmed_reload_restores_the_last_good_file(tmp_path: Path) -> None:
    adapter, gateway, _ = _fake_adapter(tmp_path)
    await adapter.current()
    good = _state(make_pub("m", ("a", "http://10.0.0.1", 1)))
    await adapter.apply(good, frozenset(good))
    good_text = (tmp_path / "ome.conf").read_text()
    gateway.refused_hosts = {"nowhere.invalid"}
    bad = _state(make_pub("m", ("a", "http://nowhere.invalid", 1), generation=2))
    result = await adapter.apply(bad, frozenset(bad))
    assert result.rejected[MapKey("ns", "m")].reason == Reason.APPLY_FAILED
    assert result.reloads == 2  # the refused one, and the one that put the last good file back
    assert (tmp_path / "ome.conf").read_text() == good_text
    assert gateway.serving == version_of(good_text)


async def test_withdrawn_maps_leave_the_file(tmp_path: Path) -> None:
    adapter, _, _ = _fake_adapter(tmp_path)
    await adapter.current()
    desired = _state(make_pub("m", ("a", "http://10.0.0.1", 1)), make_pub("n", ("a", "http://10.0.0.2", 1)))
    await adapter.apply(desired, frozenset(desired))
    del desired[MapKey("ns", "m")]
    await adapter.apply(desired, frozenset({MapKey("ns", "m")}))
    assert read_back((tmp_path / "ome.conf").read_text())[0] == desired


# --- Real NGINX --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_real_nginx_splits_weights_and_answers_503_and_404(tmp_path: Path) -> None:
    async with Backends(("a", "b", "c", "d", "z")) as backends, running_nginx(tmp_path) as nginx:
        adapter = NginxAdapter(nginx.options())
        try:
            await adapter.current()
            desired = _state(
                make_pub("one", ("a", backends.endpoint("a"), 3), ("b", backends.endpoint("b"), 1),
                         ("z", backends.endpoint("z"), 0)),
                make_pub("two", ("c", backends.endpoint("c"), 2), ("d", backends.endpoint("d"), 3)),
                make_pub("zero", ("a", backends.endpoint("a"), 0), ("b", backends.endpoint("b"), 0)),
                make_pub("empty"),
            )
            result = await adapter.apply(desired, frozenset(desired))
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
        adapter = NginxAdapter(nginx.options(rewrite_host=True))
        try:
            await adapter.current()
            desired = _state(
                make_pub("rw", ("a", backends.endpoint("a"), 2), ("b", backends.endpoint("b"), 3),
                         ("z", backends.endpoint("z"), 0))
            )
            result = await adapter.apply(desired, frozenset(desired))
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
        adapter = NginxAdapter(nginx.options(nginx_min_reload_interval=2.0))
        key = MapKey("ns", "m")

        def state(i: int) -> dict[MapKey, Publication]:
            # The last change sends everything to a.
            return _state(make_pub("m", ("a", backends.endpoint("a"), i), ("b", backends.endpoint("b"), 50 - i),
                                   generation=i))

        try:
            await adapter.current()
            await adapter.apply(state(0), frozenset({key}))
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
                    result = await adapter.apply(latest["state"], frozenset({key}))
                    assert result.rejected == {}
                    reloads += result.reloads
                    applied = version
            assert reloads <= 2
            assert read_back(nginx.conf_file.read_text())[0] == state(50)
            assert await measure(nginx.url, "m.example.com", 100) == {"a": 100}
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_isolates_a_map_it_refuses(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, running_nginx(tmp_path) as nginx:
        adapter = NginxAdapter(
            nginx.options(nginx_pid_file=None, nginx_reload_cmd=nginx.command("-s", "reload"),
                          nginx_test_cmd=nginx.command("-t", "-q"), nginx_min_reload_interval=0.2)
        )
        try:
            await adapter.current()
            first = _state(make_pub("bad", ("a", backends.endpoint("a"), 1)), make_pub("ok", ("a", backends.endpoint("a"), 1)))
            assert (await adapter.apply(first, frozenset(first))).rejected == {}
            second = _state(
                make_pub("bad", ("b", "http://no-such-host.invalid:8000", 1), generation=2),
                make_pub("ok", ("b", backends.endpoint("b"), 1), generation=2),
            )
            result = await adapter.apply(second, frozenset(second))
            assert set(result.rejected) == {MapKey("ns", "bad")}
            assert "no-such-host.invalid" in result.rejected[MapKey("ns", "bad")].message
            assert await measure(nginx.url, "ok.example.com", 20) == {"b": 20}
            assert await measure(nginx.url, "bad.example.com", 20) == {"a": 20}
            assert "no-such-host" not in nginx.conf_file.read_text()
        finally:
            await adapter.aclose()


@pytest.mark.slow
async def test_real_nginx_keeps_serving_the_old_config_when_a_reload_fails(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, running_nginx(tmp_path) as nginx:
        adapter = NginxAdapter(nginx.options(nginx_min_reload_interval=0.2), confirm_timeout=2.0)
        try:
            await adapter.current()
            good = _state(make_pub("m", ("a", backends.endpoint("a"), 1)))
            await adapter.apply(good, frozenset(good))
            good_text = nginx.conf_file.read_text()
            bad = _state(make_pub("m", ("a", "http://no-such-host.invalid", 1), generation=2))
            result = await adapter.apply(bad, frozenset(bad))
            assert result.rejected[MapKey("ns", "m")].reason == Reason.APPLY_FAILED
            assert nginx.conf_file.read_text() == good_text
            await eventually(lambda: "no-such-host.invalid" in nginx.errors())
            assert await measure(nginx.url, "m.example.com", 20) == {"a": 20}
        finally:
            await adapter.aclose()


@pytest.mark.parametrize("hostname", ["chat.example.com\n", "chat.example.com;", "chat.example.com }"], ids=["newline", "semicolon", "brace"])
def test_a_hostname_that_could_end_a_directive_is_refused(hostname: str) -> None:
    pub = make_pub("m", ("a", "http://127.0.0.1:8000", 1))
    bad = Publication(pub.namespace, pub.name, hostname, pub.generation, pub.observed_isvc_generation, pub.backends)
    assert problem(bad, rewrite_host=False) is not None
