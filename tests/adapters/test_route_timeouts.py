"""Route timeouts for LLM serving (adapters/timeouts.py), in every gateway (issue 27, item 4).

Envoy's routes set no timeout, so Envoy's default of 15 s cut every answer longer than that: a
backend answering after 26 s got a 504, and a stream was cut at 15 s whatever its tokens. NGINX's
reload mode waited 60 s at most between two reads. Pure: what each renderer writes, one source for
the options (flags, environment, config file, chart values). Marked slow: the four real gateways
(Envoy in file and xDS mode, NGINX in reload and Lua mode) side by side, each serving a stream of
more than two minutes and a first byte after more than a minute, all at once so the suite pays
the two minutes once; and the idle timeout ending what outlasts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from envoy.config.route.v3 import route_pb2

from adapters import ADAPTERS
from adapters.engine import Engine
from adapters.envoy import EnvoyOptions
from adapters.envoy.bootstrap import bootstrap, xds_bootstrap
from adapters.envoy.files import EnvoyFileTransport
from adapters.envoy.render import RDS_FILE, read_routes, render, route_timeouts
from adapters.envoy.process import run_envoy
from adapters.envoy import build as envoy_build
from adapters.envoy.resources import XdsRenderer
from adapters.httproute import HttpRouteOptions, HttpRouteRenderer, render_route
from adapters.nginx import NginxOptions
from adapters.nginx.lua_snippet import http_snippet
from adapters.nginx.reload_render import read_back
from adapters.nginx.reload_render import render as nginx_render
from adapters.timeouts import envoy_duration, unit_duration
from publisher.cli import config
from publisher.cli import main
from publisher.core.values import Backend, MapKey, Publication, Route
from tests.adapters.nginx_fixtures import running_lua_nginx, running_nginx
from tests.gateways import eventually, free_port

KEY = MapKey("models", "llama")
HOST = "llama.example.com"
ROUTE = Route(HOST, (Backend("a", "http://10.0.0.1:8000", 3), Backend("b", "http://10.0.0.2:8000", 1)))


# --- pure: what each gateway is given -------------------------------------------------------------


def _envoy_file_action(**options: float) -> dict[str, Any]:
    rds = json.loads(render({KEY: ROUTE}, **options).rds)  # type: ignore[arg-type]
    return rds["resources"][0]["virtual_hosts"][0]["routes"][0]["route"]  # type: ignore[no-any-return]


def _envoy_xds_action(**options: float) -> route_pb2.RouteAction:
    part = XdsRenderer(**options).render(KEY, ROUTE)  # type: ignore[arg-type]
    return route_pb2.RouteConfiguration.FromString(part.route_config.body).virtual_hosts[0].routes[0].route


def test_envoy_routes_have_no_total_deadline_and_an_hour_idle_timeout_by_default():
    action = _envoy_file_action()
    assert (action["timeout"], action["idle_timeout"]) == ("0s", "3600s")
    xds = _envoy_xds_action()
    assert xds.HasField("timeout") and xds.timeout.ToMilliseconds() == 0  # present: 0s, not Envoy's 15 s
    assert xds.idle_timeout.ToSeconds() == 3600


def test_envoy_routes_take_the_configured_timeouts_in_both_modes():
    action = _envoy_file_action(timeout=600.0, idle_timeout=90.5)
    assert (action["timeout"], action["idle_timeout"]) == ("600s", "90.500s")
    xds = _envoy_xds_action(timeout=600.0, idle_timeout=90.5)
    assert (xds.timeout.ToMilliseconds(), xds.idle_timeout.ToMilliseconds()) == (600_000, 90_500)


def test_an_all_zero_envoy_route_answers_503_with_no_route_action():
    rds = json.loads(render({KEY: Route(HOST, (Backend("a", "http://10.0.0.1:8000", 0),))}).rds)
    envoy_route = rds["resources"][0]["virtual_hosts"][0]["routes"][0]
    assert envoy_route["direct_response"] == {"status": 503} and "route" not in envoy_route


def test_envoy_options_build_renderers_with_the_timeouts(tmp_path):
    for options in (
        EnvoyOptions(envoy_dir=tmp_path, route_timeout="10m", route_idle_timeout="5m"),
        EnvoyOptions(envoy_xds_listen="127.0.0.1:18000", route_timeout="10m", route_idle_timeout="5m"),
    ):
        renderer = envoy_build(options)[0]
        assert (renderer.timeout, renderer.idle_timeout) == (600.0, 300.0)


def _location(text: str) -> str:
    return text[text.index("server_name " + HOST) :]


@pytest.mark.parametrize("rewrite_host", [False, True])
def test_nginx_reload_mode_sets_the_idle_timeout_both_ways_and_passes_bytes_on_unbuffered(rewrite_host):
    location = _location(nginx_render({KEY: ROUTE}, rewrite_host=rewrite_host))
    for line in ("proxy_read_timeout 1h;", "proxy_send_timeout 1h;", "proxy_buffering off;"):
        assert line in location
    custom = _location(nginx_render({KEY: ROUTE}, rewrite_host=rewrite_host, idle_timeout=90.5))
    assert "proxy_read_timeout 1m30s500ms;" in custom and "proxy_send_timeout 1m30s500ms;" in custom


def test_nginx_lua_snippet_sets_the_idle_timeout_both_ways_and_passes_bytes_on_unbuffered(tmp_path):
    def snippet(**options: float) -> str:
        return http_snippet(listen="8080", control_listen="127.0.0.1:8082", secret_file=tmp_path / "secret", **options)

    for line in ("proxy_read_timeout 1h;", "proxy_send_timeout 1h;", "proxy_buffering off;"):
        assert line in snippet()
    assert "proxy_read_timeout 5m;" in snippet(idle_timeout=300.0) and "proxy_send_timeout 5m;" in snippet(idle_timeout=300.0)
    with pytest.raises(ValueError, match="24h"):
        snippet(idle_timeout=25 * 3600.0)


def test_nginx_config_takes_the_idle_timeout_as_a_flag(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdefghij\n")
    common = ["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(secret)]
    assert main([*common, "--route-idle-timeout", "10m"]) == 0
    assert "proxy_read_timeout 10m;" in capsys.readouterr().out
    assert main([*common, "--route-idle-timeout", "25h"]) == 2
    assert "--route-idle-timeout: '25h' is longer than 24h" in capsys.readouterr().err


def test_nginx_lua_mode_refuses_a_run_idle_timeout_that_belongs_to_nginx_config(tmp_path):
    with pytest.raises(ValueError, match="nginx-config --route-idle-timeout"):
        NginxOptions(nginx_secret_file=tmp_path / "secret", route_idle_timeout="5m")
    assert NginxOptions(nginx_secret_file=tmp_path / "secret").route_idle_timeout == 3600.0


def _httproute_options(**overrides: Any) -> HttpRouteOptions:
    return HttpRouteOptions(**{"gateway": "gateways/global", "backend_port": 8080, **overrides})


@pytest.mark.parametrize(("route_timeout", "deadline"), [(None, "0s"), ("10m", "10m"), ("1.5s", "1s500ms"), ("24h", "24h")])
def test_httproute_rules_say_the_total_timeout_and_zero_disables_it(route_timeout, deadline):
    """Gateway API: `0s` disables the timeout, and unset it is the implementation's (Envoy
    Gateway's is 15 s); each number in a Duration has at most five digits, units largest first."""
    options = _httproute_options(**({} if route_timeout is None else {"route_timeout": route_timeout}))
    (rule,) = render_route(HttpRouteRenderer(options).render(KEY, ROUTE), options)["spec"]["rules"]
    assert rule["timeouts"] == {"request": deadline}


def test_a_route_written_without_timeouts_reads_back_as_not_ours_and_is_rewritten():
    from adapters.httproute import parse_route

    options = _httproute_options()
    written = render_route(HttpRouteRenderer(options).render(KEY, ROUTE), options)
    assert parse_route(written, options)[1]
    del written["spec"]["rules"][0]["timeouts"]  # as an older sidecar wrote it
    assert not parse_route(written, options)[1]


def test_an_api_server_that_drops_the_timeouts_is_named_once_in_the_log(caplog):
    """An HTTPRoute CRD older than Gateway API v1.2 prunes `timeouts`: the gateway keeps its own
    deadline, which the log says once, naming the fix."""
    from adapters.httproute import HttpRouteTransport

    options = _httproute_options()
    transport = HttpRouteTransport(options)
    applied = render_route(HttpRouteRenderer(options).render(KEY, ROUTE), options)
    transport._check_timeouts_kept(applied)
    assert not caplog.records
    del applied["spec"]["rules"][0]["timeouts"]
    transport._check_timeouts_kept(applied)
    transport._check_timeouts_kept(applied)
    (record,) = caplog.records
    assert "Gateway API's CRDs v1.2 or later" in record.getMessage()


# --- after the timeouts change (an upgrade from a sidecar that set none): every map is rewritten -----


def _without_timeouts(rds_text: str) -> str:
    document = json.loads(rds_text)
    for host in document["resources"][0]["virtual_hosts"]:
        for envoy_route in host["routes"]:
            for name in ("timeout", "idle_timeout"):
                envoy_route.get("route", {}).pop(name, None)
    return json.dumps(document)


IDLE = MapKey("models", "idle")
IDLE_ROUTE = Route("idle.example.com", (Backend("a", "http://10.0.0.1:8000", 0),))


def test_envoy_reads_a_route_served_with_other_timeouts_as_not_served():
    text = render({KEY: ROUTE, IDLE: IDLE_ROUTE}).rds
    now = route_timeouts(0.0, 3600.0)
    assert read_routes(text, timeouts=now)[1] == {KEY: ROUTE, IDLE: IDLE_ROUTE}
    assert read_routes(text, timeouts=route_timeouts(0.0, 300.0))[1] == {IDLE: IDLE_ROUTE}  # a 503 has no timeouts
    old = _without_timeouts(text)
    assert read_routes(old)[1] == {KEY: ROUTE, IDLE: IDLE_ROUTE}
    assert read_routes(old, timeouts=now)[1] == {IDLE: IDLE_ROUTE}
    assert read_routes(yaml.safe_dump(json.loads(old)), timeouts=now)[1] == {IDLE: IDLE_ROUTE}


async def test_an_envoy_file_written_with_other_timeouts_is_rewritten_at_start():
    """A sidecar that set no timeouts (or other ones) wrote the files: the first apply after a
    restart writes every map again, not only the next one that changes."""
    from tests.adapters.test_envoy import FakeIO

    io = FakeIO()
    pubs = {KEY: Publication(KEY.namespace, KEY.name, HOST, 1, 1, ROUTE.backends),
            IDLE: Publication(IDLE.namespace, IDLE.name, IDLE_ROUTE.hostname, 1, 1, IDLE_ROUTE.backends)}  # fmt: skip

    def engine(**options: Any) -> Any:
        opts = EnvoyOptions(envoy_dir=Path("/nonexistent"), envoy_admin="http://fake", **options)
        renderer, _ = envoy_build(EnvoyOptions(envoy_dir=Path("/nonexistent"), **options))
        return Engine("envoy", renderer, EnvoyFileTransport(opts, io=io))

    first = engine()
    await first.start()
    await first.apply(pubs)
    # As the older sidecar wrote it, and Envoy took it.
    old = json.loads(_without_timeouts(io.files[RDS_FILE]))
    old["version_info"] = io._versions[RDS_FILE] = "01d"
    io.files[RDS_FILE] = json.dumps(old)
    io.writes.clear()
    restarted = engine()
    assert dict(await restarted.start()) == {IDLE: IDLE_ROUTE}
    assert (await restarted.apply(pubs)).wrote and RDS_FILE in io.writes
    assert read_routes(io.files[RDS_FILE], timeouts=route_timeouts(0.0, 3600.0))[1] == {KEY: ROUTE, IDLE: IDLE_ROUTE}
    io.writes.clear()
    changed = engine(route_idle_timeout="5m")
    assert dict(await changed.start()) == {IDLE: IDLE_ROUTE}
    assert (await changed.apply(pubs)).wrote
    action = json.loads(io.files[RDS_FILE])["resources"][0]["virtual_hosts"]
    assert [host["routes"][0].get("route", {}).get("idle_timeout") for host in action] == [None, "300s"]


def test_nginx_reads_a_map_proxied_with_another_idle_timeout_as_not_served():
    text = nginx_render({KEY: ROUTE, IDLE: IDLE_ROUTE})
    assert read_back(text, idle_timeout=3600.0) == ({KEY: ROUTE, IDLE: IDLE_ROUTE}, [])
    assert read_back(text, idle_timeout=300.0) == ({IDLE: IDLE_ROUTE}, [])  # a 503 proxies nothing
    old = "".join(line for line in text.splitlines(keepends=True) if "proxy_read_timeout" not in line and "proxy_send_timeout" not in line)
    assert read_back(old) == ({KEY: ROUTE, IDLE: IDLE_ROUTE}, [])
    assert read_back(old, idle_timeout=3600.0) == ({IDLE: IDLE_ROUTE}, [])
    rewritten = nginx_render({KEY: ROUTE, IDLE: IDLE_ROUTE}, rewrite_host=True, idle_timeout=300.0)
    assert read_back(rewritten, idle_timeout=300.0) == ({KEY: ROUTE, IDLE: IDLE_ROUTE}, [])


async def test_an_nginx_file_proxying_with_another_idle_timeout_is_rewritten_at_start(tmp_path):
    from tests.adapters.test_nginx import FakeNginx, _fake_adapter

    pubs = {KEY: Publication(KEY.namespace, KEY.name, HOST, 1, 1, ROUTE.backends),
            IDLE: Publication(IDLE.namespace, IDLE.name, IDLE_ROUTE.hostname, 1, 1, IDLE_ROUTE.backends)}  # fmt: skip
    first, gateway, _ = _fake_adapter(tmp_path)
    await first.start()
    await first.apply(pubs)
    assert "proxy_read_timeout 1h;" in (tmp_path / "ome.conf").read_text()
    restarted, regateway, _ = _fake_adapter(tmp_path, FakeNginx(tmp_path / "ome.conf", serving=gateway.serving), route_idle_timeout="5m")
    assert dict(await restarted.start()) == {IDLE: IDLE_ROUTE}
    assert (await restarted.apply(pubs)).wrote and regateway.reloads == 1
    text = (tmp_path / "ome.conf").read_text()
    assert "proxy_read_timeout 5m;" in text and "1h" not in text


@pytest.mark.parametrize(
    ("seconds", "envoy", "unit"),
    [(0, "0s", "0s"), (0.25, "0.250s", "250ms"), (90, "90s", "1m30s"), (3600, "3600s", "1h"), (86400, "86400s", "24h")],
)
def test_durations_in_each_gateways_spelling(seconds, envoy, unit):
    assert (envoy_duration(seconds), unit_duration(seconds)) == (envoy, unit)


def test_the_options_are_flags_environment_variables_and_config_keys_with_bounds(tmp_path):
    base = {"adapter": "envoy", "envoy_dir": str(tmp_path)}
    loaded = config.adapter_options(config.load({**base, "route_timeout": "10m"}, {"OME_PUBLISHER_ROUTE_IDLE_TIMEOUT": "5m"}))
    assert (loaded.route_timeout, loaded.route_idle_timeout) == (600.0, 300.0)
    (tmp_path / "options.yaml").write_text("route-idle-timeout: 2m\n")
    from_file = config.adapter_options(config.load({**base, "config": str(tmp_path / "options.yaml")}, {}))
    assert (from_file.route_timeout, from_file.route_idle_timeout) == (0.0, 120.0)
    defaults = config.adapter_options(config.load(base, {}))
    assert (defaults.route_timeout, defaults.route_idle_timeout) == (0.0, 3600.0)
    for flags, words in (
        ({"route_idle_timeout": "0"}, "--route-idle-timeout: '0' must be longer than zero"),
        ({"route_idle_timeout": "25h"}, "--route-idle-timeout: '25h' is longer than 24h"),
        ({"route_timeout": "-1s"}, "--route-timeout"),
    ):
        with pytest.raises(config.ConfigError, match=words):
            config.adapter_options(config.load({**base, **flags}, {}))


def test_run_help_shows_both_options_with_their_defaults(capsys):
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--route-timeout DURATION envoy and httproute adapters:" in text
    assert "--route-idle-timeout DURATION envoy and nginx adapters:" in text
    assert "default: 0s)" in text and "default: 1h)" in text


# --- real gateways ----------------------------------------------------------------------------------

# The stream: a token every few seconds for longer than two minutes. The slow answer: its first
# byte after more than a minute, past Envoy's old 15 s and NGINX's old 60 s between reads.
STREAM_SECONDS = 130.0
TOKEN_INTERVAL = 5.0
FIRST_BYTE_AFTER = 70.0


@dataclass
class LlmBackend:
    """One HTTP server standing in for a model server: `/stream` sends server-sent events, one
    token every `interval` seconds over `seconds`, then `[DONE]`; `/late` answers after `after`
    seconds. It notes when it sent each stream's last token."""

    seconds: float = STREAM_SECONDS
    interval: float = TOKEN_INTERVAL
    after: float = FIRST_BYTE_AFTER
    port: int = 0
    last_token_sent: dict[str, float] = field(default_factory=dict)
    _runner: web.AppRunner | None = None

    @property
    def tokens(self) -> int:
        return int(self.seconds // self.interval) + 1

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for index in range(self.tokens):
            if index:
                await asyncio.sleep(self.interval)
            await response.write(f"data: token-{index}\n\n".encode())
        self.last_token_sent[request.query.get("id", "")] = time.monotonic()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _late(self, request: web.Request) -> web.Response:
        # Stops waiting once the gateway gave up and closed the connection: nothing outlives a test.
        deadline = time.monotonic() + self.after
        while time.monotonic() < deadline and request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return web.Response(text="late answer")

    async def __aenter__(self) -> LlmBackend:
        app = web.Application()
        app.router.add_get("/stream", self._stream)
        app.router.add_get("/late", self._late)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@dataclass
class Streamed:
    status: int | None = None
    tokens: list[str] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None


async def read_stream(url: str, stream_id: str, *, bound: float) -> Streamed:
    """GET a stream through a gateway, noting when each token arrives; a cut stream is an error
    noted, not raised, so every gateway's outcome is reported together."""
    result = Streamed()
    timeout = aiohttp.ClientTimeout(total=bound)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{url}stream?id={stream_id}", headers={"Host": HOST}) as response:
                result.status = response.status
                async for line in response.content:
                    text = line.decode().strip()
                    if text == "data: [DONE]":
                        result.done = True
                    elif text.startswith("data: "):
                        result.tokens.append(text[len("data: ") :])
                        result.arrived.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def get(url: str, *, bound: float) -> tuple[int | None, str]:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=bound)) as session:
            async with session.get(url, headers={"Host": HOST}) as response:
                return response.status, await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _publication(endpoint: str) -> Publication:
    return Publication(KEY.namespace, KEY.name, HOST, 1, 1, (Backend("a", endpoint, 1),))


async def _publish(engine: Any, endpoint: str) -> None:
    result = await engine.apply({KEY: _publication(endpoint)})
    assert result.rejected == {}


Gateways = dict[str, str]  # name -> URL serving HOST


@contextlib.asynccontextmanager
async def _envoy_files(tmp_path: Path, endpoint: str, options: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    directory = tmp_path / "envoy-files"
    directory.mkdir()
    listen, admin = free_port(), free_port()
    opts = EnvoyOptions(envoy_dir=directory, envoy_admin=f"http://127.0.0.1:{admin}", **options)
    config_ = yaml.safe_load(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen, admin_host="127.0.0.1", admin_port=admin))
    edit(config_)
    boot = tmp_path / "envoy-files.yaml"
    boot.write_text(yaml.safe_dump(config_))
    engine = ADAPTERS["envoy"].engine("envoy", opts)
    try:
        assert await engine.start() == {}
        async with run_envoy(boot, admin_url=opts.envoy_admin, log_path=tmp_path / "envoy-files.log"):
            await _publish(engine, endpoint)
            yield f"http://127.0.0.1:{listen}/"
    finally:
        await engine.aclose()


@contextlib.asynccontextmanager
async def _envoy_xds(tmp_path: Path, endpoint: str, options: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    xds, listen, admin = free_port(), free_port(), free_port()
    engine = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_xds_listen=f"127.0.0.1:{xds}", **options))
    serving = asyncio.create_task(engine.serve())
    try:
        await asyncio.wait_for(engine.transport.started(), 10)
        config_ = yaml.safe_load(xds_bootstrap(xds_host="127.0.0.1", xds_port=xds, listen_host="127.0.0.1", listen_port=listen,
                                               admin_host="127.0.0.1", admin_port=admin))  # fmt: skip
        edit(config_)
        boot = tmp_path / "envoy-xds.yaml"
        boot.write_text(yaml.safe_dump(config_))
        async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy-xds.log"):
            await eventually(lambda: len(engine.transport.envoys()) >= 1, timeout=20)
            await _publish(engine, endpoint)
            yield f"http://127.0.0.1:{listen}/"
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.aclose()


@contextlib.asynccontextmanager
async def _nginx_reload(tmp_path: Path, endpoint: str, options: dict[str, Any]) -> AsyncIterator[str]:
    async with running_nginx(tmp_path / "nginx-reload") as nginx:
        engine = ADAPTERS["nginx"].engine("nginx", nginx.options(**options))
        try:
            await _publish(engine, endpoint)
            yield nginx.url
        finally:
            await engine.aclose()


@contextlib.asynccontextmanager
async def _nginx_lua(tmp_path: Path, endpoint: str, idle_timeout: float | None) -> AsyncIterator[str]:
    async with running_lua_nginx(tmp_path / "nginx-lua", start=False) as nginx:
        if idle_timeout is not None:  # what `nginx-config --route-idle-timeout` writes
            text = (nginx.directory / "ome-lua.conf").read_text()
            (nginx.directory / "ome-lua.conf").write_text(text.replace("_timeout 1h;", f"_timeout {unit_duration(idle_timeout)};"))
        await nginx.start()
        engine = ADAPTERS["nginx"].engine("nginx", nginx.options())
        try:
            await _publish(engine, endpoint)
            yield nginx.url
        finally:
            await engine.aclose()


def _keep(config_: dict[str, Any]) -> None:
    pass


@contextlib.asynccontextmanager
async def four_gateways(
    tmp_path: Path,
    endpoint: str,
    *,
    idle_timeout: float | None = None,
    edit_envoy: Callable[[dict[str, Any]], None] = _keep,
) -> AsyncIterator[Gateways]:
    """Envoy in file and xDS mode, NGINX in reload and Lua mode, each publishing HOST to
    `endpoint` with the default timeouts, or the given idle timeout. `edit_envoy` changes both
    Envoy bootstraps."""
    envoy_options = {} if idle_timeout is None else {"route_idle_timeout": idle_timeout}
    async with contextlib.AsyncExitStack() as stack:
        gateways = {
            "envoy files": await stack.enter_async_context(_envoy_files(tmp_path, endpoint, envoy_options, edit_envoy)),
            "envoy xds": await stack.enter_async_context(_envoy_xds(tmp_path, endpoint, envoy_options, edit_envoy)),
            "nginx reload": await stack.enter_async_context(_nginx_reload(tmp_path, endpoint, envoy_options)),
            "nginx lua": await stack.enter_async_context(_nginx_lua(tmp_path, endpoint, idle_timeout)),
        }
        yield gateways


async def _all(coroutines: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    values = await asyncio.gather(*coroutines.values())
    return dict(zip(coroutines, values))


@pytest.mark.slow
async def test_every_gateway_serves_a_stream_of_over_two_minutes_and_a_first_byte_after_a_minute(tmp_path):
    """All four gateways at once, with the defaults: each stream arrives whole (every token, then
    [DONE]) and as it is made (its first token before the backend sent its last), and the answer
    whose first byte takes 70 s is that answer, not a 504. Envoy cut both at 15 s before."""
    async with LlmBackend() as backend, four_gateways(tmp_path, backend.endpoint) as gateways:
        bound = STREAM_SECONDS + 60
        streams = {name: read_stream(url, name, bound=bound) for name, url in gateways.items()}
        lates = {name: get(f"{url}late", bound=bound) for name, url in gateways.items()}
        streamed, late = await asyncio.gather(_all(streams), _all(lates))
    expected = [f"token-{index}" for index in range(backend.tokens)]
    problems = []
    for name, result in streamed.items():
        if (result.status, result.tokens, result.done, result.error) != (200, expected, True, None):
            problems.append(f"{name} stream: status {result.status}, {len(result.tokens)} of {len(expected)} tokens, "
                            f"done {result.done}, error {result.error}")  # fmt: skip
        elif not result.arrived[0] < backend.last_token_sent[name]:
            problems.append(f"{name} stream: the first token arrived only after the backend sent the last: buffered")
    problems += [f"{name} late answer: {answer}" for name, answer in late.items() if answer != (200, "late answer")]
    assert not problems, "\n".join(problems)
    assert backend.tokens > 20 and (backend.tokens - 1) * backend.interval > 120


@pytest.mark.slow
async def test_every_gateway_ends_a_request_idle_for_longer_than_its_idle_timeout(tmp_path):
    """With a 4 s idle timeout, a first byte after 10 s is a gateway timeout (504), and a stream
    with a token a second for 6 s arrives whole: the idle timeout is between bytes, not a deadline."""
    async with LlmBackend(seconds=6.0, interval=1.0, after=10.0) as backend, \
            four_gateways(tmp_path, backend.endpoint, idle_timeout=4.0) as gateways:  # fmt: skip
        streams = {name: read_stream(url, name, bound=30) for name, url in gateways.items()}
        lates = {name: get(f"{url}late", bound=30) for name, url in gateways.items()}
        streamed, late = await asyncio.gather(_all(streams), _all(lates))
    assert {name: status for name, (status, _) in late.items()} == dict.fromkeys(gateways, 504)
    assert {name: (result.done, len(result.tokens)) for name, result in streamed.items()} == dict.fromkeys(gateways, (True, 7))


def _stream_idle_timeout(seconds: str) -> Callable[[dict[str, Any]], None]:
    def edit(config_: dict[str, Any]) -> None:
        for listener in config_["static_resources"]["listeners"]:
            for chain in listener["filter_chains"]:
                for network_filter in chain["filters"]:
                    network_filter["typed_config"]["stream_idle_timeout"] = seconds

    return edit


@pytest.mark.slow
async def test_envoys_connection_manager_idle_timeout_does_not_undercut_the_routes(tmp_path):
    """The route's idle_timeout replaces the connection manager's stream idle timeout (Envoy's
    default 5 min, here 1 s): a first byte after 3 s is answered through both Envoys."""
    async with LlmBackend(after=3.0) as backend, contextlib.AsyncExitStack() as stack:
        edit = _stream_idle_timeout("1s")
        urls = {
            "envoy files": await stack.enter_async_context(_envoy_files(tmp_path, backend.endpoint, {}, edit)),
            "envoy xds": await stack.enter_async_context(_envoy_xds(tmp_path, backend.endpoint, {}, edit)),
        }
        answers = await _all({name: get(f"{url}late", bound=30) for name, url in urls.items()})
    assert answers == dict.fromkeys(urls, (200, "late answer"))



@pytest.mark.slow
async def test_an_xds_sidecar_restarted_with_another_idle_timeout_sends_it_to_the_envoy_serving_the_old_one(tmp_path):
    """xDS mode re-renders what it reads back from the Envoys: a changed timeout reaches them
    without waiting for the map to change."""
    xds, listen, admin = free_port(), free_port(), free_port()

    @contextlib.asynccontextmanager
    async def sidecar(**options: Any) -> AsyncIterator[Any]:
        engine = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_xds_listen=f"127.0.0.1:{xds}", **options))
        serving = asyncio.create_task(engine.serve())
        try:
            await asyncio.wait_for(engine.transport.started(), 10)
            yield engine
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await engine.aclose()

    async def idle_timeouts() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"http://127.0.0.1:{admin}/config_dump?resource=dynamic_route_configs") as response:
                dump = await response.json(content_type=None)
        return [r["route"]["idle_timeout"] for c in dump["configs"] for h in c["route_config"]["virtual_hosts"] for r in h["routes"]]

    boot = tmp_path / "envoy.yaml"
    boot.write_text(xds_bootstrap(xds_host="127.0.0.1", xds_port=xds, listen_host="127.0.0.1", listen_port=listen,
                                  admin_host="127.0.0.1", admin_port=admin))  # fmt: skip
    async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
        async with sidecar() as first:
            await eventually(lambda: len(first.transport.envoys()) >= 1, timeout=20)
            await _publish(first, "http://127.0.0.1:1")
            assert await idle_timeouts() == ["3600s"]
        async with sidecar(route_idle_timeout="5m") as restarted:  # Envoy keeps serving meanwhile
            await eventually(lambda: len(restarted.transport.envoys()) >= 1, timeout=20)
            assert dict(await restarted.start()) == {KEY: Route(HOST, (Backend("a", "http://127.0.0.1:1", 1),))}
            await eventually(_equal(idle_timeouts, ["300s"]), timeout=10)


def _equal(read: Callable[[], Awaitable[Any]], expected: Any) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(await read() == expected)

    return check
