"""NGINX Lua mode (adapters/nginx/lua.py, lua_render.py, lua_snippet.py) and its Lua modules: the
pure renderer and snippet, and real NGINX (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import NotConnected, Rejected, Unavailable
from adapters.engine import Engine
from adapters.nginx import NginxOptions
from adapters.nginx.lua import LuaStats, LuaTransport
from adapters.nginx.lua_render import LuaPart, LuaRenderer, checksum, decode_entry, entry_text
from adapters.nginx.lua_snippet import LUA_DIR, copy_lua_modules, http_snippet
from publisher.cli import app
from publisher import metrics
from publisher.cli import main
from publisher.cli.config import RunConfig
from publisher.core.values import Backend, MapKey, Publication, Reason, Route
from tests.loop_turns import loop_turns
from tests.adapters.nginx_fixtures import RunningLuaNginx, running_lua_nginx
from tests.gateways import Backends, assert_measured_split, eventually, free_port, measure

KEY = MapKey("ns", "m")
HOST = "m.example.com"


def route(hostname: str = HOST, *backends: tuple[str, str, int]) -> Route:
    return Route(hostname, tuple(Backend(c, e, w) for c, e, w in backends))


# --- Pure: renderer, entry text, snippet, options ------------------------------------------------------


def test_render_finds_each_endpoint_name_and_port() -> None:
    part = LuaRenderer().render(KEY, route(HOST, ("a", "https://a.example.net", 3), ("b", "http://[::1]:8000/", 1)))
    assert [(b.name, b.port, b.weight) for b in part.backends] == [("a.example.net", 443, 3), ("::1", 8000, 1)]
    assert part.route() == route(HOST, ("a", "https://a.example.net", 3), ("b", "http://[::1]:8000/", 1))


def test_problem_refuses_an_endpoint_path_and_allows_mixed_schemes() -> None:
    renderer = LuaRenderer()
    assert renderer.problem(KEY, route(HOST, ("a", "http://10.0.0.1/v1", 1))) is not None
    assert renderer.problem(KEY, route(HOST, ("a", "http://10.0.0.1", 1), ("b", "https://b.example.net", 1))) is None


def test_more_backends_than_the_lua_table_takes_is_invalid_plan_up_front(tmp_path: Path) -> None:
    """Issue 21, finding 12: 65 backends passed every check, then NGINX refused the map on every
    push (ApplyFailed, retried forever). `test_the_backend_limit_is_the_lua_tables` pins the 64."""
    engine = Engine("nginx", LuaRenderer(), LuaTransport(NginxOptions(nginx_secret_file=tmp_path / "s")))
    backends = tuple(Backend(f"c{i}", "http://127.0.0.1:1", 1) for i in range(65))
    held = engine.check(Publication("ns", "m", HOST, 1, 1, backends))
    assert held is not None and held.reason == Reason.INVALID_PLAN and "at most 64" in held.message
    assert engine.check(Publication("ns", "m", HOST, 1, 1, backends[:64])) is None


def test_entry_text_is_canonical_and_reads_back() -> None:
    part = LuaRenderer(rewrite_host=True).render(KEY, route(HOST, ("b", "http://b.svc:81", 0), ("a", "http://a.svc", 2)))
    addresses = {"a.svc": ("10.0.0.1",), "b.svc": ("10.0.0.2", "10.0.0.3")}
    text = entry_text(part, addresses)
    assert text == entry_text(part, dict(reversed(addresses.items())))
    assert decode_entry(text) == (part, addresses)
    assert json.loads(text) == {"h": HOST, "r": True, "b": [["b", "http://b.svc:81", 0, ["10.0.0.2", "10.0.0.3"]],
                                                            ["a", "http://a.svc", 2, ["10.0.0.1"]]]}  # fmt: skip


def test_checksum_ignores_order_and_sees_every_byte() -> None:
    a, b = {KEY: "x"}, {MapKey("ns", "n"): "y"}
    assert checksum(a | b) == checksum(b | a)
    assert checksum({KEY: "x "}) != checksum(a)
    assert checksum({}) == "0000000000000"


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"listen": "80; server { listen 9"}, id="listen"),
        pytest.param({"control_listen": "127.0.0.1:1 x"}, id="control-listen"),
        pytest.param({"shared_dict_size": "32m; lua_code_cache off"}, id="size"),
        pytest.param({"secret_file": Path('/a";\n}')}, id="secret-file"),
        pytest.param({"ca_file": Path("/a b")}, id="ca-file"),
    ],
)
def test_http_snippet_refuses_values_nginx_would_read_as_syntax(overrides: dict) -> None:
    arguments = {"listen": "8080", "control_listen": "127.0.0.1:8082", "secret_file": Path("/s"), **overrides}
    with pytest.raises(ValueError):
        http_snippet(**arguments)


def test_nginx_config_command_prints_the_snippet_and_the_load_module_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef\n")
    code = main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(secret),
                 "--shared-dict-size", "64m", "--ca-file", "/etc/ome/ca.pem"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    for line in ["lua_shared_dict ome_routes 64m;", "listen 127.0.0.1:8082;", f'init("{secret}")',
                 "proxy_ssl_trusted_certificate /etc/ome/ca.pem;", "proxy_ssl_verify on;", "listen 8080 default_server;"]:  # fmt: skip
        assert line in out
    assert main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", "/s", "--load-modules"]) == 0
    assert "load_module modules/ngx_http_lua_module.so;" in capsys.readouterr().out


def test_nginx_config_lua_dir_copies_the_modules_and_names_the_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23, finding 9: the chart's init container rewrote the snippet's module path with sed."""
    copy = tmp_path / "nginx" / "lua"
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef\n")  # nginx-config refuses a secret NGINX would (issue 23, finding 10)
    assert main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(secret), "--lua-dir", str(copy)]) == 0
    assert f'lua_package_path "{copy}/?.lua;;";' in capsys.readouterr().out
    shipped = sorted(path.name for path in LUA_DIR.glob("*.lua"))
    assert shipped and sorted(path.name for path in copy.iterdir()) == shipped
    assert all((copy / name).read_bytes() == (LUA_DIR / name).read_bytes() for name in shipped)
    (tmp_path / "file").write_text("")
    assert main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(secret), "--lua-dir", str(tmp_path / "file" / "lua")]) == 2
    assert "--lua-dir" in capsys.readouterr().err


def test_options_mode_lua_by_default_reload_when_a_conf_file_is_given(tmp_path: Path) -> None:
    assert NginxOptions(nginx_secret_file=tmp_path / "s").nginx_mode == "lua"
    reload = NginxOptions(nginx_conf_file=tmp_path / "f.conf", nginx_pid_file=tmp_path / "pid")
    assert reload.nginx_mode == "reload"
    with pytest.raises(ValueError, match="nginx_secret_file"):
        NginxOptions(nginx_mode="lua")
    with pytest.raises(ValueError, match="nginx_conf_file"):
        NginxOptions(nginx_mode="reload", nginx_pid_file=tmp_path / "pid")


# --- Real NGINX with the Lua module ----------------------------------------------------------------


@dataclass
class Lua:
    """A running NGINX, a transport on it, and the parts the engine would hold."""

    nginx: RunningLuaNginx
    transport: LuaTransport
    renderer: LuaRenderer = field(default_factory=LuaRenderer)
    parts: dict[MapKey, LuaPart] = field(default_factory=dict)

    async def push(self, changes: Mapping[MapKey, Route | None]):  # type: ignore[no-untyped-def]
        rendered = {key: None if r is None else self.renderer.render(key, r) for key, r in changes.items()}
        parts = {**self.parts, **{k: p for k, p in rendered.items() if p is not None}}
        for key in [k for k, p in rendered.items() if p is None]:
            parts.pop(key, None)
        result = await self.transport.write(parts, rendered)
        self.parts = {k: p for k, p in parts.items() if k not in result.rejected}
        return result

    async def control(self, method: str, path: str, body: str | None = None, *, secret: str | None = "") -> tuple[int, dict]:
        """A raw control request: (status, the answer's JSON head line with "lines": the rest).
        secret "" means the right one, None none at all."""
        headers = {}
        if secret is not None:
            headers["Authorization"] = f"Bearer {secret or self.nginx.secret_file.read_text().strip()}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.request(method, self.nginx.control_url + path, data=body, headers=headers) as response:
                head, _, rest = (await response.text()).partition("\n")
                return response.status, {**json.loads(head), "lines": sorted(rest.splitlines())}


async def fake_resolve(name: str, port: int) -> tuple[str, ...]:
    """Every test name is this host."""
    with contextlib.suppress(ValueError):
        return (str(ipaddress.ip_address(name)),)
    if name.endswith(".test"):
        return ("127.0.0.1",)
    raise OSError(f"{name}: no such test name")


@contextlib.asynccontextmanager
async def lua_nginx(directory: Path, **nginx_options) -> AsyncIterator[Lua]:  # type: ignore[no-untyped-def]
    async with running_lua_nginx(directory, **nginx_options) as nginx:
        transport = LuaTransport(nginx.options(), resolve=fake_resolve)
        try:
            yield Lua(nginx, transport)
        finally:
            await transport.aclose()


@contextlib.asynccontextmanager
async def serving(transport: LuaTransport) -> AsyncIterator[None]:
    task = asyncio.create_task(transport.serve())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.slow
@pytest.mark.parametrize(
    "weights",
    [
        pytest.param({"a": 3, "b": 1}, id="3-1"),
        pytest.param({"a": 2, "b": 3}, id="2-3"),
        pytest.param({"a": 70, "b": 30, "c": 0}, id="70-30-0"),
    ],
)
async def test_split_measured_the_conformance_way(tmp_path: Path, weights: dict[str, int]) -> None:
    async with Backends(tuple(weights)) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({KEY: route(HOST, *((n, backends.endpoint(n), w) for n, w in weights.items()))})
        await assert_measured_split(lua.nginx.url, HOST, weights)
        # The client's Host passes through unless rewrite_host says otherwise.
        assert set().union(*(set(c) for c in backends.host_headers.values())) == {HOST}


@pytest.mark.slow
async def test_unknown_host_404_all_zero_503_wildcard_matches_deeper_names(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({
            KEY: route(HOST, ("a", backends.endpoint("a"), 0)),
            MapKey("ns", "wild"): route("*.wild.example.com", ("a", backends.endpoint("a"), 1)),
            MapKey("ns", "empty"): route("empty.example.com"),
        })  # fmt: skip
        assert await measure(lua.nginx.url, HOST, 20) == {"status:503": 20}
        assert await measure(lua.nginx.url, "empty.example.com", 5) == {"status:503": 5}
        assert await measure(lua.nginx.url, "other.example.com", 20) == {"status:404": 20}
        assert await measure(lua.nginx.url, "x.y.wild.example.com", 20) == {"a": 20}
        assert await measure(lua.nginx.url, "wild.example.com", 5) == {"status:404": 5}
        assert backends.hits["a"] == 20


@pytest.mark.slow
async def test_a_change_is_live_within_a_second_and_removal_gives_404(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1), ("b", backends.endpoint("b"), 0))})
        assert await measure(lua.nginx.url, HOST, 20) == {"a": 20}
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 0), ("b", backends.endpoint("b"), 1))})
        await eventually(lambda: _all_to(lua, "b"), timeout=1.0)
        await lua.push({KEY: None})
        assert await measure(lua.nginx.url, HOST, 10) == {"status:404": 10}
        assert await lua.transport.read() == {}


async def _all_to(lua: Lua, backend: str) -> bool:
    return await measure(lua.nginx.url, HOST, 20) == {backend: 20}


class _Streamer:
    """A backend whose /stream sends a chunk every 10 ms until told to finish, then `END`."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> _Streamer:
        app = web.Application()
        app.router.add_get("/stream", self._stream)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.finish.set()
        assert self._runner is not None
        await self._runner.cleanup()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(3000):  # bounded: 30 s at most
            if self.finish.is_set():
                break
            await response.write(b"token\n")
            await asyncio.sleep(0.01)
        await response.write(b"END\n")
        await response.write_eof()
        return response


@pytest.mark.slow
async def test_50_changes_reload_nothing_and_a_stream_lasts_through_them_uncut(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, _Streamer() as streamer, lua_nginx(tmp_path) as lua:
        stream_route = route("stream.example.com", ("s", f"http://127.0.0.1:{streamer.port}", 1))
        await lua.push({MapKey("ns", "stream"): stream_route})
        pids = lua.nginx.pids()
        received: list[bytes] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.get(lua.nginx.url + "stream", headers={"Host": "stream.example.com"}) as response:
                assert response.status == 200
                received.append(await response.content.readline())
                for i in range(50):
                    await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), i % 3), ("b", backends.endpoint("b"), 1))})
                    state = (await lua.control("GET", "/state"))[1]
                    assert state["version"] == i + 2
                streamer.finish.set()
                async for line in response.content:
                    received.append(line)
        assert received[0] == b"token\n" and received[-1] == b"END\n" and len(received) > 2
        assert lua.nginx.pids() == pids, "the master or a worker changed: NGINX reloaded or restarted"
        assert "reconfiguring" not in lua.nginx.errors()
        await assert_measured_split(lua.nginx.url, HOST, {"a": 1, "b": 1}, requests=400)


@pytest.mark.slow
async def test_a_malformed_batch_or_a_request_without_the_secret_changes_nothing(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1))})
        before = (await lua.control("GET", "/table"))[1]
        good = entry_text(lua.renderer.render(MapKey("ns", "n"), route("n.example.com", ("a", "http://127.0.0.1:1", 1))),
                          {"127.0.0.1": ("127.0.0.1",)})  # fmt: skip
        bad_entries = {
            "injected-hostname": good.replace("n.example.com", "n.example.com; }"),
            "weight-above-max": good.replace(',1,["', ',1000001,["'),
            "fractional-weight": good.replace(',1,["', ',0.5,["'),
            "address-not-ip": good.replace('["127.0.0.1"]', '["evil.example"]'),
            "endpoint-with-path": good.replace("127.0.0.1:1", "127.0.0.1:1/x;"),
            "endpoint-port-too-big": good.replace("127.0.0.1:1", "127.0.0.1:65536"),
            "unknown-field": good.replace('{"h"', '{"lua":"os.exit()","h"'),
            "not-json": good[:-3],
        }
        head = '{"replace":false}'
        for case, text in bad_entries.items():
            status, answer = await lua.control("POST", "/batch", f"{head}\nset ns/n {good}\nset ns/o {text}")
            assert status == 400, (case, answer)
            assert answer["version"] == before["version"] and answer["checksum"] == before["checksum"], case
        for case, batch in {
            "head-not-an-object": "[1, 2]",
            "unknown-verb": f"{head}\nput ns/n {good}",
            "hostname-taken": f"{head}\nset ns/n {good.replace('n.example.com', HOST)}",
            "bad-key": f"{head}\nset ns/N_ {good}",
            "set-and-delete": f"{head}\nset ns/n {good}\ndelete ns/n",
            "set-twice": f"{head}\nset ns/n {good}\nset ns/n {good}",
        }.items():
            status, answer = await lua.control("POST", "/batch", batch)
            assert status == 400, (case, answer)
        for secret in (None, "wrong-secret-0123456789abcdef"):
            status, _ = await lua.control("POST", "/batch", '{}\ndelete ns/m', secret=secret)
            assert status == 401
            assert (await lua.control("GET", "/table", secret=secret))[0] == 401
        assert (await lua.control("GET", "/table"))[1] == before
        assert await measure(lua.nginx.url, HOST, 10) == {"a": 10}


@pytest.mark.slow
async def test_a_batch_larger_than_the_table_is_refused_whole_and_the_table_is_unchanged(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path, shared_dict_size="128k") as lua:
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1))})
        before = (await lua.control("GET", "/table"))[1]
        many = {MapKey("ns", f"m{i}"): route(f"m{i}.example.com", ("a", backends.endpoint("a"), 1)) for i in range(2000)}
        with pytest.raises(Rejected, match="table full"):
            await lua.push(many)
        assert (await lua.control("GET", "/table"))[1] == before
        assert lua.transport.stats.failures["table_full"] == 1
        assert lua.transport.stats.bytes_free is not None and lua.transport.stats.bytes_used
        assert await measure(lua.nginx.url, HOST, 10) == {"a": 10}
        assert await measure(lua.nginx.url, "m1.example.com", 5) == {"status:404": 5}


def _scraped_table_series(stats: LuaStats) -> dict[str, float]:
    metrics.watch_nginx_table(stats)
    try:
        families = list(text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()))
    finally:
        metrics.watch_nginx_table(None)
    return {sample.name + "".join(f"{{{v}}}" for v in sample.labels.values()): sample.value
            for family in families if family.name.startswith(metrics.PREFIX + "nginx_") for sample in family.samples}  # fmt: skip


@pytest.mark.slow
async def test_the_transport_counters_are_exported_as_prometheus_series(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path, shared_dict_size="128k") as lua, serving(lua.transport):
        await lua.push({KEY: route(HOST, ("a", "http://127.0.0.1:1", 1))})
        many = {MapKey("ns", f"m{i}"): route(f"m{i}.example.com", ("a", "http://127.0.0.1:1", 1)) for i in range(2000)}
        with pytest.raises(Rejected):
            await lua.push(many)
        await lua.nginx.restart()
        await eventually(lambda: lua.transport.stats.restarts_detected == 1, timeout=5)
        state = (await lua.control("GET", "/state"))[1]
        series = _scraped_table_series(lua.transport.stats)
        prefix = metrics.PREFIX + "nginx_"
        assert series[prefix + "table_pushes_total"] == 2, "the map, then the table restored"
        assert series[prefix + "table_failures_total{table_full}"] == 1
        assert series[prefix + "table_failures_total{unreachable}"] == 0, "every reason exported from 0"
        assert series[prefix + "restarts_detected_total"] == 1
        assert series[prefix + "table_free_bytes"] == state["bytes_free"]
        assert series[prefix + "table_used_bytes"] == state["bytes_used"]
    assert not [name for name in _scraped_table_series(LuaStats()) if "bytes" in name], "no bytes before NGINX answered"
    metrics.watch_nginx_table(None)
    assert not any(f.name.startswith(metrics.PREFIX + "nginx_") for f in metrics.REGISTRY.collect())


@pytest.mark.slow
async def test_run_in_lua_mode_exports_its_transports_table_series(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    async with running_lua_nginx(tmp_path / "nginx") as nginx:
        config = RunConfig(source=f"dir:{maps}", adapter="nginx", nginx_mode="lua", nginx_control_url=nginx.control_url,
                           nginx_secret_file=nginx.secret_file, once=True)  # fmt: skip
        try:
            await app.run(config)
            names = {family.name for family in metrics.REGISTRY.collect()}
        finally:
            metrics.watch_nginx_table(None)
    prefix = metrics.PREFIX + "nginx_"
    assert {prefix + "table_pushes", prefix + "table_free_bytes", prefix + "restarts_detected"} <= names


@pytest.mark.slow
async def test_the_transport_warns_before_the_table_fills(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with lua_nginx(tmp_path, shared_dict_size="128k") as lua:
        for batch in range(100):  # bounded: 128k holds far fewer than 1,000 maps
            maps = {MapKey("ns", f"m{batch}-{i}"): route(f"m{batch}-{i}.example.com", ("a", "http://127.0.0.1:1", 1)) for i in range(10)}
            try:
                await lua.push(maps)
            except Rejected:
                break
        else:
            pytest.fail("the table never filled")
        warnings = [r for r in caplog.records if r.getMessage() == "nginx table almost full"]
        assert len(warnings) == 1, "warned once, on the transition"
        assert caplog.records.index(warnings[0]) < caplog.records.index(
            next(r for r in caplog.records if r.getMessage() == "nginx refused batch"))


def _one_map_batch(index: int, weight: int = 1) -> str:
    text = entry_text(LuaRenderer().render(MapKey("ns", f"m{index}"), route(f"m{index}.example.com", ("a", "http://127.0.0.1:1", weight))),
                      {"127.0.0.1": ("127.0.0.1",)})  # fmt: skip
    return f'{{"replace":false}}\nset ns/m{index} {text}'


async def _changes(lua: Lua, since: int, *, wait: float = 0, boot: str | None = None) -> tuple[int, dict]:
    boot = boot or (await lua.control("GET", "/state"))[1]["boot"]
    return await lua.control("GET", f"/changes?boot={boot}&since={since}&wait={wait}")


@pytest.mark.slow
async def test_changes_since_a_version_list_exactly_the_maps_changed_after_it_and_reads_change_nothing(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path) as lua:
        a, b, c, d = (MapKey("ns", name) for name in "abcd")
        await lua.push({key: route(f"{key.name}.example.com", ("a", "http://127.0.0.1:1", 1)) for key in (a, b, c)})
        since = (await lua.control("GET", "/state"))[1]["version"]
        await lua.push({a: route("a.example.com", ("a", "http://127.0.0.1:1", 5))})
        await lua.push({b: None, d: route("d.example.com", ("a", "http://127.0.0.1:1", 1))})
        await lua.push({a: route("a.example.com", ("a", "http://127.0.0.1:1", 7))})
        before = (await lua.control("GET", "/table"))[1]
        status, answer = await _changes(lua, since)
        assert status == 200
        entries = dict(line.split(" ", 1) for line in before["lines"])
        assert answer["lines"] == sorted([f"set ns/a {entries['ns/a']}", "delete ns/b", f"set ns/d {entries['ns/d']}"])
        assert json.loads(entries["ns/a"])["b"][0][2] == 7, "the current entry, not the one logged first"
        assert {k: answer[k] for k in ("version", "checksum", "boot")} == {k: before[k] for k in ("version", "checksum", "boot")}
        status, answer = await _changes(lua, before["version"])
        assert (status, answer["lines"]) == (200, [])
        status, answer = await _changes(lua, before["version"] - 1)
        assert answer["lines"] == [f"set ns/a {entries['ns/a']}"]
        assert (await lua.control("GET", "/table"))[1] == before, "reads change neither the table nor its room"


@pytest.mark.slow
async def test_changes_from_an_unknown_version_say_read_the_table_instead(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path, shared_dict_size="8m") as lua:
        await lua.control("POST", "/batch", _one_map_batch(0))
        state = (await lua.control("GET", "/state"))[1]
        for since, boot in [(state["version"] + 1, None), (0, "0123456789abcdef")]:
            status, answer = await _changes(lua, since, boot=boot)
            assert status == 410 and "read /table instead" in answer["error"], (since, boot)
        assert (await _changes(lua, 0))[0] == 200
        # More versions than the log keeps: the oldest go, the recent ones still answer.
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {lua.nginx.secret_file.read_text().strip()}"}) as session:
            for index in range(1030):
                async with session.post(lua.nginx.control_url + "/batch", data=_one_map_batch(index % 7, 2 + index)) as response:
                    assert response.status == 200
        version = (await lua.control("GET", "/state"))[1]["version"]
        assert (await _changes(lua, state["version"]))[0] == 410
        status, answer = await _changes(lua, version - 1000)
        assert status == 200 and sorted(line.split(" ")[1] for line in answer["lines"]) == [f"ns/m{i}" for i in range(7)]
        # A batch larger than the log empties it: a reader before it must read the table.
        many = "\n".join(["{}"] + [_one_map_batch(i).split("\n")[1] for i in range(100, 4300)])
        assert (await lua.control("POST", "/batch", many))[0] == 200
        after = (await lua.control("GET", "/state"))[1]["version"]
        assert (await _changes(lua, after - 1))[0] == 410
        assert (await _changes(lua, after))[0] == 200


@pytest.mark.slow
async def test_a_long_poll_answers_once_the_version_moves_and_empty_when_the_wait_ends(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path) as lua:
        version = (await lua.control("GET", "/state"))[1]["version"]
        status, answer = await _changes(lua, version, wait=0.3)
        assert (status, answer["version"], answer["lines"]) == (200, version, [])
        waiting = asyncio.create_task(_changes(lua, version, wait=30))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "it waits while nothing changes"
        await lua.push({KEY: route(HOST, ("a", "http://127.0.0.1:1", 1))})
        status, answer = await asyncio.wait_for(waiting, 10)  # well before its 30 s wait ends
        assert status == 200 and answer["version"] == version + 1
        assert [line.split(" ")[:2] for line in answer["lines"]] == [["set", str(KEY)]]
        assert (await lua.control("GET", f"/changes?boot=x&since={version}&wait=31"))[0] == 400


@pytest.mark.slow
async def test_a_reader_following_changes_while_both_workers_apply_batches_ends_with_the_table(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path, workers=2) as lua:
        headers = {"Authorization": f"Bearer {lua.nginx.secret_file.read_text().strip()}"}
        state = (await lua.control("GET", "/state"))[1]
        boot, version, view = state["boot"], state["version"], {}
        writes_done = asyncio.Event()

        async def write(session: aiohttp.ClientSession, start: int) -> None:
            # Sets and deletes among 12 maps; two writers, so batches land on both workers.
            for n in range(start, 300, 2):
                lines = [_one_map_batch((n + i) % 12, 2 + n).split("\n")[1] for i in range(n % 3 + 1)]
                body = "\n".join(['{}', *lines] + ([f"delete ns/m{(n + 5) % 12}"] if n % 4 == 0 else []))
                async with session.post(lua.nginx.control_url + "/batch", data=body) as response:
                    assert response.status == 200, await response.text()

        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=4)) as session:
            writers = asyncio.gather(write(session, 0), write(session, 1))
            writers.add_done_callback(lambda _: writes_done.set())
            for _ in range(2000):  # bounded: each answer moves the version or ends a 0.5 s wait
                status, answer = await lua.control("GET", f"/changes?boot={boot}&since={version}&wait=0.5")
                assert status == 200, answer
                for line in answer["lines"]:
                    verb, key, *entry = line.split(" ", 2)
                    if verb == "set":
                        view[key] = entry[0]
                    else:
                        view.pop(key, None)
                version = answer["version"]
                if writes_done.is_set() and version == (await lua.control("GET", "/state"))[1]["version"]:
                    break
            await writers
        table = (await lua.control("GET", "/table"))[1]
        assert table["version"] == version
        assert view == dict(line.split(" ", 1) for line in table["lines"])
        assert checksum({MapKey(*key.split("/")): text for key, text in view.items()}) == table["checksum"]


@pytest.mark.slow
async def test_a_full_table_drops_the_change_log_before_it_refuses_a_batch(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path, shared_dict_size="128k") as lua:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {lua.nginx.secret_file.read_text().strip()}"}) as session:
            for index in range(2000):  # bounded: 128k holds far fewer maps
                async with session.post(lua.nginx.control_url + "/batch", data=_one_map_batch(index)) as response:
                    if response.status != 200:
                        break
            else:
                pytest.fail("the table never filled")
        assert response.status == 507
        before = (await lua.control("GET", "/table"))[1]
        assert len(before["lines"]) == index, "every batch before the refused one was applied"
        # The refused batch found the log emptied for its room first: readers read the table.
        assert (await _changes(lua, before["version"] - 1))[0] == 410
        status, answer = await lua.control("POST", "/batch", _one_map_batch(index))
        assert status == 507 and answer["version"] == before["version"]
        assert (await lua.control("GET", "/table"))[1] == before
        assert (await _changes(lua, before["version"]))[0] == 200


@pytest.mark.slow
async def test_an_nginx_restart_is_detected_and_the_table_restored_within_a_second(tmp_path: Path) -> None:
    async with Backends(("a", "b")) as backends, lua_nginx(tmp_path) as lua, serving(lua.transport):
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 3), ("b", backends.endpoint("b"), 1))})
        boot = (await lua.control("GET", "/state"))[1]["boot"]
        await lua.nginx.restart()
        await eventually(lambda: _all_answered(lua), timeout=1.0)
        assert (await lua.control("GET", "/state"))[1]["boot"] != boot
        assert lua.transport.stats.restarts_detected == 1
        await assert_measured_split(lua.nginx.url, HOST, {"a": 3, "b": 1}, requests=400)
        # A write after the restart lands on the restored table, not on an empty one.
        await lua.push({MapKey("ns", "n"): route("n.example.com", ("b", backends.endpoint("b"), 1))})
        assert set(await lua.transport.read()) == {KEY, MapKey("ns", "n")}


async def _all_answered(lua: Lua) -> bool:
    counts = await measure(lua.nginx.url, HOST, 8)
    return not any(name.startswith("status:") for name in counts)


@pytest.mark.slow
async def test_a_write_racing_a_restart_restores_first_then_applies(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1))})
        await lua.nginx.restart()  # no serve(): the write is the first to see the new boot id
        await lua.push({MapKey("ns", "n"): route("n.example.com", ("a", backends.endpoint("a"), 1))})
        assert set(await lua.transport.read()) == {KEY, MapKey("ns", "n")}
        assert await measure(lua.nginx.url, HOST, 5) == {"a": 5}


@pytest.mark.slow
async def test_a_new_sidecar_reads_the_table_back_and_writes_nothing_when_nothing_changed(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        desired = {KEY: route(HOST, ("a", backends.endpoint("a"), 1))}
        await lua.push(desired)
        version = (await lua.control("GET", "/state"))[1]["version"]
        fresh = LuaTransport(lua.nginx.options(), resolve=fake_resolve)
        try:
            assert await fresh.read() == desired
            part = lua.renderer.render(KEY, desired[KEY])
            await fresh.write({KEY: part}, {KEY: part})
            assert fresh.stats.pushes == 0
        finally:
            await fresh.aclose()
        assert (await lua.control("GET", "/state"))[1]["version"] == version


@pytest.mark.slow
async def test_a_read_back_of_the_table_as_confirmed_reads_no_table_and_any_other_write_or_restart_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with lua_nginx(tmp_path) as lua:
        desired = {KEY: route(HOST, ("a", "http://127.0.0.1:1", 1))}
        await lua.push(desired)
        paths: list[str] = []
        request = lua.transport._request

        async def recorded(method: str, path: str, body: str | None = None):  # type: ignore[no-untyped-def]
            paths.append(path.partition("?")[0])
            return await request(method, path, body)

        monkeypatch.setattr(lua.transport, "_request", recorded)
        assert await lua.transport.read() == desired
        assert paths == ["/changes"], "a resync of an unchanged table is one small answer"
        other = MapKey("ns", "other")
        assert (await lua.control("POST", "/batch", _one_map_batch(9).replace("ns/m9", str(other))))[0] == 200
        paths.clear()
        assert set(await lua.transport.read()) == {KEY, other}
        assert paths == ["/changes", "/table"]
        await lua.nginx.restart()
        paths.clear()
        assert set(await lua.transport.read()) == {KEY, other}
        assert paths[:2] == ["/changes", "/table"] and "/batch" in paths, "the restart is seen and the table restored"
        assert lua.transport.stats.restarts_detected == 1


@pytest.mark.slow
async def test_a_name_that_does_not_resolve_rejects_only_its_map(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        result = await lua.push({
            KEY: route(HOST, ("a", backends.endpoint("a"), 1)),
            MapKey("ns", "n"): route("n.example.com", ("a", "http://nowhere.invalid", 1)),
        })  # fmt: skip
        assert set(result.rejected) == {MapKey("ns", "n")} and "nowhere.invalid" in result.rejected[MapKey("ns", "n")]
        assert set(await lua.transport.read()) == {KEY}


@pytest.mark.slow
async def test_a_dead_address_is_retried_on_the_same_backend_only(tmp_path: Path) -> None:
    async def resolve(name: str, port: int) -> tuple[str, ...]:
        return {"multi.test": ("127.0.0.1", "127.0.0.2")}.get(name) or await fake_resolve(name, port)

    async with Backends(("a", "b")) as backends, running_lua_nginx(tmp_path) as nginx:
        # Nothing listens on 127.0.0.2: every request that lands there is retried on 127.0.0.1.
        transport = LuaTransport(nginx.options(), resolve=resolve)
        lua = Lua(nginx, transport)
        try:
            await lua.push({KEY: route(HOST, ("a", f"http://multi.test:{backends.ports['a']}", 1),
                                       ("b", backends.endpoint("b"), 0))})  # fmt: skip
            assert await measure(nginx.url, HOST, 40) == {"a": 40}
            assert backends.hits["b"] == 0
        finally:
            await transport.aclose()


@pytest.mark.slow
async def test_names_are_re_resolved_and_a_moved_address_is_pushed(tmp_path: Path) -> None:
    addresses = {"svc.test": ("127.0.0.1",)}

    async def resolve(name: str, port: int) -> tuple[str, ...]:
        return addresses[name]

    async with Backends(("a",)) as backends, running_lua_nginx(tmp_path) as nginx:
        port = backends.ports["a"]
        transport = LuaTransport(nginx.options(), resolve=resolve, resolve_interval=0.2, poll_interval=0.05)
        lua = Lua(nginx, transport)
        try:
            await lua.push({KEY: route(HOST, ("a", f"http://svc.test:{port}", 1))})
            assert await measure(nginx.url, HOST, 5) == {"a": 5}
            async with serving(transport):
                addresses["svc.test"] = ("127.0.0.2",)  # nothing listens there
                await eventually(lambda: _served_addresses(lua), timeout=5)
            assert await measure(nginx.url, HOST, 5) == {"status:502": 5}
        finally:
            await transport.aclose()


@pytest.mark.slow
async def test_ip_literals_are_never_looked_up_and_a_name_is_looked_up_once_whatever_its_ports(tmp_path: Path) -> None:
    lookups: list[str] = []

    async def resolve(name: str, port: int) -> tuple[str, ...]:
        lookups.append(name)
        return ("127.0.0.1",)

    async with running_lua_nginx(tmp_path) as nginx:
        transport = LuaTransport(nginx.options(), resolve=resolve, resolve_interval=0.05, poll_interval=0.02)
        lua = Lua(nginx, transport)
        try:
            await lua.push({
                KEY: route(HOST, ("a", "http://127.0.0.1:1", 1), ("b", "http://[::1]:2", 1), ("c", "http://svc.test:3", 1)),
                MapKey("ns", "n"): route("n.example.com", ("a", "http://127.0.0.1:4", 1), ("c", "http://svc.test:5", 1)),
            })  # fmt: skip
            assert lookups == ["svc.test"]
            async with serving(transport):
                await eventually(lambda: len(lookups) >= 3, timeout=5)
            assert set(lookups) == {"svc.test"}, "only the name is re-resolved"
            served = decode_entry(dict(line.split(" ", 1) for line in (await lua.control("GET", "/table"))[1]["lines"])["ns/m"])[1]
            assert served == {"127.0.0.1": ("127.0.0.1",), "::1": ("::1",), "svc.test": ("127.0.0.1",)}
        finally:
            await transport.aclose()


async def _served_addresses(lua: Lua) -> bool:
    (line,) = (await lua.control("GET", "/table"))[1]["lines"]
    return json.loads(line.partition(" ")[2])["b"][0][3] == ["127.0.0.2"]


@pytest.mark.slow
async def test_an_nginx_not_answered_yet_is_waited_for_and_one_that_stops_answering_is_unavailable(tmp_path: Path) -> None:
    """Issue 21, finding 7: the first read failed at once (Unavailable), and the sidecar exited 2
    when it started before NGINX."""
    async with running_lua_nginx(tmp_path, start=False) as nginx:
        transport = LuaTransport(nginx.options(), resolve=fake_resolve)
        try:
            part = LuaRenderer().render(KEY, route(HOST, ("a", "http://127.0.0.1:1", 1)))
            with pytest.raises(NotConnected):
                await transport.write({KEY: part}, {KEY: part})
            assert "not answered" in (transport.unready() or "")
            reading = asyncio.create_task(transport.read())
            await nginx.start()
            assert await asyncio.wait_for(reading, 10) == {}
            assert transport.unready() is None
            await transport.write({KEY: part}, {KEY: part})
            await nginx.stop()
            with pytest.raises(Unavailable) as raised:
                await transport.read()
            assert not isinstance(raised.value, NotConnected)
            assert transport.unready() is None, "NGINX keeps serving its table: the loop's window decides"
        finally:
            await transport.aclose()


# --- https: per-request SNI, verified, never a connection verified for another name ---------------------


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA, and a key and certificate it signed for good.test only: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ome test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "good.test")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("good.test")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


@pytest.mark.slow
async def test_https_backend_with_the_wrong_certificate_name_is_refused_even_after_a_verified_one(tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    hits: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        hits.append(request.headers["Host"])
        return web.Response(text="tls", headers={"x-ome-backend": "tls"})

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with lua_nginx(tmp_path / "nginx", ca_file=ca) as lua:
            lua.renderer = LuaRenderer(rewrite_host=True)
            # Both names are the same address and port: only the certificate check tells them apart.
            await lua.push({
                MapKey("ns", "good"): route("good.example.com", ("tls", f"https://good.test:{port}", 1)),
                MapKey("ns", "bad"): route("bad.example.com", ("tls", f"https://bad.test:{port}", 1)),
            })  # fmt: skip
            statuses: dict[str, list[int]] = {"good.example.com": [], "bad.example.com": []}
            bodies: dict[str, set[str]] = {"good.example.com": set(), "bad.example.com": set()}
            # One client connection for all requests, alternating names, so any upstream connection
            # NGINX kept from a verified request would be there to reuse.
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:
                for _ in range(10):
                    for host in statuses:
                        async with session.get(lua.nginx.url, headers={"Host": host}) as response:
                            bodies[host].add(await response.text())
                            statuses[host].append(response.status)
            # On a mismatch, say who answered and why: the bodies and NGINX's error log.
            why = f"answers {bodies}\nerror.log:\n{lua.nginx.errors()}"
            assert statuses["good.example.com"] == [200] * 10, why
            assert statuses["bad.example.com"] == [502] * 10, why
            assert hits == ["good.test"] * 10, why
            assert "certificate verify failed" in lua.nginx.errors() or "does not match" in lua.nginx.errors()
    finally:
        await runner.cleanup()


# --- The Lua modules: read once, by the master, so no worker needs their files -------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["removed", "unreadable"])
async def test_workers_route_with_the_modules_read_at_start_whatever_becomes_of_their_files(tmp_path: Path, loss: str) -> None:
    """Issue 27, item 3: NGINX's workers run as another user than the master that read the snippet
    (nobody for an NGINX started as root without `user`, www-data with Debian's nginx.conf), and
    loaded ome_route.lua at their first request: with the modules where only root reads (a package
    or checkout under /root or a `mktemp -d` directory), every request was answered 500 ("module
    'ome_route' not found") while the control listener, loaded by the master, confirmed every
    write. Files removed or replaced after the start (a package upgraded in place) did the same."""
    if loss == "unreadable" and os.geteuid() != 0:
        pytest.skip("NGINX's workers run as another user only when NGINX starts as root")
    lua_dir = tmp_path / "private" / "lua"
    copy_lua_modules(lua_dir)
    (tmp_path / "private").chmod(0o700)
    async with Backends(("a",)) as backends, lua_nginx(tmp_path / "nginx", lua_dir=lua_dir) as lua:
        if loss == "removed":
            shutil.rmtree(lua_dir)
        await lua.push({KEY: route(HOST, ("a", backends.endpoint("a"), 1))})
        assert await measure(lua.nginx.url, HOST, 20) == {"a": 20}, lua.nginx.errors()


# --- Issue 21, finding 6: all or nothing under memory pressure, repair, restore, secret, lock ----------


async def _fill_with_one_map_batches(lua: Lua, session: aiohttp.ClientSession, first: int = 1) -> int:
    """One-map batches until NGINX refuses one for room (the log already dropped): the dict then
    has no free page. Returns how many were applied."""
    for index in range(first, 5000):  # bounded: the small dicts of these tests hold far fewer
        async with session.post(lua.nginx.control_url + "/batch", data=_one_map_batch(index)) as response:
            if response.status != 200:
                assert response.status == 507, await response.text()
                return index - first
    pytest.fail("the table never filled")


def _grown(backends: int) -> Route:
    """m0's route with `backends` long-named backends: an entry of several pages."""
    return route("m0.example.com", *((f"backend-{i:02d}-" + "x" * 48, "http://127.0.0.1:1", 1) for i in range(backends)))


@pytest.mark.slow
async def test_a_refused_batch_that_grows_an_entry_leaves_every_entry_version_and_checksum_as_before(tmp_path: Path) -> None:
    """safe_set of a larger value frees the old one before it fails for room: the entry it tried
    to grow used to vanish (its host 404) behind a 507 that said nothing was applied."""
    async with Backends(("a",)) as backends, lua_nginx(tmp_path, shared_dict_size="128k", workers=1) as lua:
        await lua.push({MapKey("ns", "m0"): route("m0.example.com", ("a", backends.endpoint("a"), 1))})
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {lua.nginx.secret_file.read_text().strip()}"}) as session:
            await _fill_with_one_map_batches(lua, session)
        before = (await lua.control("GET", "/table"))[1]
        with pytest.raises(Rejected, match="table full"):
            await lua.push({MapKey("ns", "m0"): _grown(64)})
        after = (await lua.control("GET", "/table"))[1]
        assert {k: after[k] for k in ("version", "checksum", "lines")} == {k: before[k] for k in ("version", "checksum", "lines")}
        assert checksum({MapKey(*line.split(" ", 1)[0].split("/")): line.split(" ", 1)[1] for line in after["lines"]}) == after["checksum"]
        assert await measure(lua.nginx.url, "m0.example.com", 5) == {"a": 5}
        assert (await lua.nginx.eval('return ngx.shared.ome_routes:get("h:m0.example.com")')) == ["ns/m0"]


async def _consistent(lua: Lua) -> dict[MapKey, str]:
    """The table's entries, checked against its own checksum."""
    table = (await lua.control("GET", "/table"))[1]
    entries = {MapKey(*line.split(" ", 1)[0].split("/")): line.split(" ", 1)[1] for line in table["lines"]}
    assert checksum(entries) == table["checksum"], "the table matches its own checksum"
    return entries


@pytest.mark.slow
async def test_a_table_that_fails_its_own_checksum_is_replaced_whole_from_the_confirmed_snapshot(tmp_path: Path) -> None:
    """It used to fail every write of every map ("does not match its own checksum") until NGINX
    restarted."""
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        m0, n = MapKey("ns", "m0"), MapKey("ns", "n")
        confirmed = {m0: route("m0.example.com", ("a", backends.endpoint("a"), 1)), n: route("n.example.com", ("a", backends.endpoint("a"), 2))}
        await lua.push(confirmed)
        # The state a batch that lost an entry left: the entry gone, its hostname and the checksum kept.
        await lua.nginx.eval('ngx.shared.ome_routes:delete("m:ns/m0")')
        with pytest.raises(Unavailable, match="did not confirm"):
            await lua.push({m0: route("m0.example.com", ("a", backends.endpoint("a"), 5))})
        assert await lua.transport.read() == confirmed
        assert set(await _consistent(lua)) == {m0, n}
        assert await measure(lua.nginx.url, "m0.example.com", 5) == {"a": 5}
        await lua.push({m0: route("m0.example.com", ("a", backends.endpoint("a"), 5))})
        assert (await lua.transport.read())[m0] == route("m0.example.com", ("a", backends.endpoint("a"), 5))


@pytest.mark.slow
async def test_a_new_sidecar_finding_a_table_that_fails_its_checksum_replaces_it_by_what_it_serves(tmp_path: Path) -> None:
    async with Backends(("a",)) as backends, lua_nginx(tmp_path) as lua:
        m0, n = MapKey("ns", "m0"), MapKey("ns", "n")
        await lua.push({m0: route("m0.example.com", ("a", backends.endpoint("a"), 1)), n: route("n.example.com", ("a", backends.endpoint("a"), 1))})
        await lua.nginx.eval('ngx.shared.ome_routes:delete("m:ns/m0")')
        fresh = LuaTransport(lua.nginx.options(), resolve=fake_resolve)
        try:
            assert await fresh.read() == {n: route("n.example.com", ("a", backends.endpoint("a"), 1))}
            assert set(await _consistent(lua)) == {n}
            # The hostname the lost entry left behind is no one's: another map may take it.
            part = lua.renderer.render(MapKey("ns", "o"), route("m0.example.com", ("a", backends.endpoint("a"), 1)))
            await fresh.write({MapKey("ns", "o"): part}, {MapKey("ns", "o"): part})
            assert await measure(lua.nginx.url, "m0.example.com", 5) == {"a": 5}
        finally:
            await fresh.aclose()


@pytest.mark.slow
async def test_a_confirmed_table_an_nginx_restarted_with_a_smaller_dict_refuses_is_unavailable_not_rejected(tmp_path: Path) -> None:
    """A refused restore was `Rejected`: the engine bisected it and every map became ApplyFailed."""
    async with lua_nginx(tmp_path, shared_dict_size="1m") as lua:
        many = {MapKey("ns", f"m{i}"): route(f"m{i}.example.com", ("a", "http://127.0.0.1:1", 1)) for i in range(600)}
        await lua.push(many)
        lua.nginx.configure(shared_dict_size="128k")
        await lua.nginx.restart()
        with pytest.raises(Unavailable, match="whole confirmed table"):
            await lua.push({MapKey("ns", "m1"): route("m1.example.com", ("a", "http://127.0.0.1:1", 2))})
        with pytest.raises(Unavailable, match="whole confirmed table"):
            await lua.transport.read()
        lua.nginx.configure(shared_dict_size="1m")
        await lua.nginx.restart()
        assert await lua.transport.read() == many


@pytest.mark.slow
async def test_the_secret_check_takes_the_same_steps_whatever_the_guess_and_its_length(tmp_path: Path) -> None:
    """It returned at once on a length mismatch, and so told a guess's length."""
    async with lua_nginx(tmp_path) as lua:
        secret = lua.nginx.secret_file.read_text().strip()
        guesses = [secret, "x" + secret[1:], secret[:-1] + "x", secret[:-1], secret + "x", "x", "y" * 200]
        # Counts the Lua VM instructions of each check (the interpreter: traces run no hooks).
        steps, answers = await lua.nginx.eval(f"""
            jit.off()
            local control = require("ome_control")
            local steps, answers = {{}}, {{}}
            for i, guess in ipairs(require("cjson").decode({json.dumps(json.dumps(guesses))})) do
                local count = 0
                debug.sethook(function() count = count + 1 end, "", 1)
                answers[i] = control.is_secret(guess)
                debug.sethook()
                steps[i] = count
            end
            return steps, answers""")
        assert answers == [True] + [False] * (len(guesses) - 1)
        # Every wrong guess alike (the right one may differ: its answer says as much).
        assert len(set(steps[1:])) == 1, dict(zip(guesses, steps))


@pytest.mark.slow
async def test_the_batch_lock_never_expires_and_is_taken_over_only_from_a_process_that_is_gone(tmp_path: Path) -> None:
    """It expired after 10 s whatever the batch; a holder that is gone is the one case to take it over."""
    async with lua_nginx(tmp_path) as lua:
        gone = await asyncio.create_subprocess_exec("true")
        await gone.wait()
        assert lua.nginx.process is not None
        for holder, status in [(f"{lua.nginx.process.pid} 1", 503), (f"{gone.pid} 1", 200)]:
            assert await lua.nginx.eval(f'return (ngx.shared.ome_routes:safe_add("meta:lock", "{holder}"))') == [True]
            assert (await lua.control("POST", "/batch", _one_map_batch(1)))[0] == status, holder
            await lua.nginx.eval('ngx.shared.ome_routes:delete("meta:lock")')
        assert (await lua.control("GET", "/state"))[1]["version"] == 1
        source = (Path(__file__).parents[2] / "adapters/nginx/lua_modules/ome_control.lua").read_text()
        assert 'safe_add("meta:lock", mine)' in source, "taken with no expiry"


@pytest.mark.slow
async def test_the_backend_limit_is_the_lua_tables(tmp_path: Path) -> None:
    async with lua_nginx(tmp_path) as lua:
        await lua.push({MapKey("ns", "m0"): _grown(64)})
        with pytest.raises(Rejected, match="at most 64"):
            await lua.push({MapKey("ns", "m0"): _grown(65)})


# --- Issue 21, findings 10 and 7: readiness while NGINX cannot be read, and start-up before NGINX ------


@dataclass
class LuaSidecar:
    port: int
    task: asyncio.Task[object]

    async def readyz(self) -> tuple[int, str]:
        """(status, body) of /readyz; (0, why) while nothing answers."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(f"http://127.0.0.1:{self.port}/readyz") as response:
                    return response.status, await response.text()
        except aiohttp.ClientError as exc:
            return 0, repr(exc)


@contextlib.asynccontextmanager
async def lua_sidecar(nginx: RunningLuaNginx, backends: Backends, directory: Path, *, resync: float) -> AsyncIterator[LuaSidecar]:
    """`ome-publisher run` in Lua mode on a directory holding the chat map (host chat.example.com,
    all of it to worker-a)."""
    import yaml

    from tests.builders import make_entry, make_isvc, make_map

    maps = directory / "maps"
    maps.mkdir()
    entries = [make_entry("worker-a", allocated=1, ready=1, weight=1, endpoint=backends.endpoint("worker-a"))]
    (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(host="chat.example.com"), make_map(entries=entries)]))
    port = free_port()
    config = RunConfig(source=f"dir:{maps}", adapter="nginx", nginx_mode="lua", nginx_control_url=nginx.control_url,
                       nginx_secret_file=nginx.secret_file, listen=f"127.0.0.1:{port}", resync=resync)  # fmt: skip
    task: asyncio.Task[object] = asyncio.create_task(app.run(config))
    try:
        yield LuaSidecar(port, task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        metrics.watch_nginx_table(None)


@pytest.mark.slow
async def test_readyz_stays_200_while_the_control_listener_is_unreachable_until_three_resync_intervals_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 10: /readyz turned 503 within a second of the control listener becoming
    unreachable, while NGINX kept serving; the README promises three resync intervals."""
    async with Backends(("worker-a",)) as backends, running_lua_nginx(tmp_path / "nginx") as nginx:
        async with lua_sidecar(nginx, backends, tmp_path, resync=1.0) as sidecar:
            await eventually(lambda: _readyz_is(sidecar, 200), timeout=20)
            await eventually(lambda: _served(nginx, {"worker-a": 4}), timeout=10)
            await nginx.stop()
            await eventually(lambda: any(r.getMessage() == "nginx control listener unavailable" for r in caplog.records), timeout=10)
            status, body = await sidecar.readyz()
            assert status == 200, body
            await eventually(lambda: _readyz_is(sidecar, 503), timeout=30)
            assert "last successful sync" in (await sidecar.readyz())[1]
            await nginx.start()
            await eventually(lambda: _readyz_is(sidecar, 200), timeout=30)
            await eventually(lambda: _served(nginx, {"worker-a": 4}), timeout=10)
            assert not sidecar.task.done()


@pytest.mark.slow
async def test_a_sidecar_started_before_nginx_waits_unready_then_publishes_once_nginx_answers(tmp_path: Path) -> None:
    """Finding 7: the sidecar exited 2 within 40 ms when NGINX's control listener did not answer
    yet, and the chart starts the sidecar first."""
    async with Backends(("worker-a",)) as backends, running_lua_nginx(tmp_path / "nginx", start=False) as nginx:
        async with lua_sidecar(nginx, backends, tmp_path, resync=60.0) as sidecar:
            await eventually(lambda: _readyz_is(sidecar, 503, "not answered"), timeout=20)
            assert not sidecar.task.done()
            await nginx.start()
            await eventually(lambda: _served(nginx, {"worker-a": 4}), timeout=20)
            await eventually(lambda: _readyz_is(sidecar, 200), timeout=20)
            assert not sidecar.task.done()


async def _readyz_is(sidecar: LuaSidecar, status: int, text: str = "") -> bool:
    if sidecar.task.done():
        sidecar.task.result()  # raises what ended the sidecar
        pytest.fail("the sidecar ended")
    answer = await sidecar.readyz()
    return answer[0] == status and text in answer[1]


async def _served(nginx: RunningLuaNginx, expected: dict[str, int]) -> bool:
    return await measure(nginx.url, "chat.example.com", sum(expected.values())) == expected


async def test_a_resync_read_of_many_unchanged_maps_gives_the_event_loop_back_between_slices(tmp_path: Path) -> None:
    """Issue 29: a resync's read of 10,000 unchanged maps built every route in one turn of the
    event loop (20-45 ms)."""
    transport = LuaTransport(NginxOptions(nginx_secret_file=tmp_path / "s"))
    renderer = LuaRenderer()
    keys = [MapKey("prod", f"m{i}") for i in range(5000)]
    transport._table.boot = "boot-1"
    transport._table._parts = {key: renderer.render(key, route(f"{key.name}.example.com", ("a", "http://10.0.0.1", 1))) for key in keys}

    async def unchanged() -> bool:  # NGINX holds what it confirmed: /changes is empty
        return True

    transport._unchanged = unchanged  # type: ignore[method-assign]
    async with loop_turns() as turns:
        served = await transport.read()
        assert turns() >= 10, f"a read of 5,000 maps let other tasks run {turns()} times"
    assert len(served) == 5000 and served[keys[7]].hostname == "m7.example.com"
