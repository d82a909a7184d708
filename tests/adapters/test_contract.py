"""The adapter contract: every gateway, run by the engine against its real gateway (or the fake
API server), keeps the same promises. A gateway joins by adding a factory to GATEWAYS that yields
a fresh engine on the same gateway each time it is called (a restart). The last section holds the
xDS gateway to its promises with several clients: two that disagree at a restart, one that leaves
mid-write, a late one's refusal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters import ADAPTERS, Engine
from adapters.base import PagedRead, Unavailable
from adapters.envoy import EnvoyOptions
from adapters.envoy.bootstrap import bootstrap, xds_bootstrap
from adapters.envoy.process import run_envoy
from adapters.envoy.resources import XdsRenderer
from adapters.json import JsonOptions
from publisher.core.model import MAX_WEIGHT
from publisher.core.values import Backend, MapKey, Publication, Reason
from tests.adapters.nginx_fixtures import running_nginx
from tests.adapters.xds_clients import ScriptedEnvoy, holding, refuse_clusters_of
from tests.gateways import eventually, free_port

EngineFactory = Callable[[], Engine[Any]]


@contextlib.asynccontextmanager
async def json_file(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    yield lambda: ADAPTERS["json"].engine("json", JsonOptions(json_path=tmp_path / "out.json"))


@contextlib.asynccontextmanager
async def json_dir(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    yield lambda: ADAPTERS["json"].engine("json", JsonOptions(json_dir=tmp_path))


@contextlib.asynccontextmanager
async def nginx_reload(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    async with running_nginx(tmp_path / "nginx") as nginx:
        options = nginx.options(nginx_pid_file=None, nginx_reload_cmd=nginx.command("-s", "reload"),
                                nginx_test_cmd=nginx.command("-t"), nginx_min_reload_interval=0)
        yield lambda: ADAPTERS["nginx"].engine("nginx", options)


@contextlib.asynccontextmanager
async def envoy_files(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    directory, listen, admin = tmp_path / "envoy", free_port(), free_port()
    directory.mkdir()
    options = EnvoyOptions(envoy_dir=directory, envoy_admin=f"http://127.0.0.1:{admin}")
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(bootstrap(envoy_dir=directory, listen_host="127.0.0.1", listen_port=listen,
                              admin_host="127.0.0.1", admin_port=admin))
    first = ADAPTERS["envoy"].engine("envoy", options)
    await first.start()  # the empty files Envoy starts from
    await first.aclose()
    async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
        yield lambda: ADAPTERS["envoy"].engine("envoy", options)


@contextlib.asynccontextmanager
async def envoy_xds(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    """Each engine is a sidecar start: its own xDS server on the same port, which the one Envoy
    reconnects to and lists what it holds. An Envoy has one control plane at a time, so a new
    engine serves once the one before it has stopped (where other gateways let two readers in)."""
    xds, listen, admin = free_port(), free_port(), free_port()
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(xds_bootstrap(xds_host="127.0.0.1", xds_port=xds, listen_host="127.0.0.1", listen_port=listen,
                                  admin_host="127.0.0.1", admin_port=admin))
    engines: list[Engine[Any]] = []
    servers: list[asyncio.Task[None]] = []

    def serving_engine() -> Engine[Any]:
        engine = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_xds_listen=f"127.0.0.1:{xds}"))
        before = engines[-1] if engines else None

        async def serve() -> None:
            if before is not None:
                await before.aclose()  # closing it again later does nothing
            await engine.serve()

        engines.append(engine)
        servers.append(asyncio.create_task(serve()))
        return engine

    serving_engine()  # Envoy starts with a control plane, as a sidecar beside it would have
    try:
        async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
            yield serving_engine
    finally:
        for server in servers:
            server.cancel()
        await asyncio.gather(*servers, return_exceptions=True)


@contextlib.asynccontextmanager
async def nginx_lua(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    from tests.adapters.nginx_fixtures import running_lua_nginx

    async with running_lua_nginx(tmp_path / "nginx") as nginx:
        yield lambda: ADAPTERS["nginx"].engine("nginx", nginx.options())


@contextlib.asynccontextmanager
async def httproute(tmp_path: Path) -> AsyncIterator[EngineFactory]:
    # No gateway controller reports on the routes: each write waits its short status timeout and
    # publishes with a note. (The engine is not asked to check() here, so the IP endpoints an
    # ExternalName Service could not hold reach the fake as they are.)
    from adapters.httproute import HttpRouteOptions
    from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig

    async with FakeKubeAPI() as api:
        options = HttpRouteOptions(gateway_kubeconfig=write_kubeconfig(tmp_path / "kubeconfig", api.url),
                                   gateway="gateways/global", backend_port=8080, route_status_timeout=0.05)
        yield lambda: ADAPTERS["httproute"].engine("httproute", options)


GATEWAYS = {
    "envoy-files": envoy_files, "envoy-xds": envoy_xds, "httproute": httproute, "json-dir": json_dir, "json-file": json_file,
    "nginx-lua": nginx_lua, "nginx-reload": nginx_reload,
}
# Gateways that start a real process.
SLOW = {"nginx-lua", "nginx-reload", "envoy-files", "envoy-xds"}


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in sorted(GATEWAYS)])
async def gateway(request, tmp_path) -> AsyncIterator[EngineFactory]:
    async with GATEWAYS[request.param](tmp_path) as factory:
        yield factory


def pub(name: str, *weights: int, host: str | None = None, generation: int = 1, created: str = "2026-01-01T00:00:00Z") -> Publication:
    backends = tuple(Backend(f"worker-{i}", f"http://127.0.0.1:{18000 + i}", w) for i, w in enumerate(weights))
    return Publication("prod", name, host or f"{name}.example.com", generation, 1, backends, created)


async def started(factory: EngineFactory) -> Engine[Any]:
    engine = factory()
    await engine.start()
    return engine


async def served(factory: EngineFactory) -> dict[MapKey, Any]:
    engine = factory()
    try:
        return dict(await engine.start())
    finally:
        await engine.aclose()


@pytest.mark.parametrize("weights", [(3, 1), (1, 0), (0, 0), (5,), (MAX_WEIGHT, 1, 0)], ids=["split", "weight-0", "all-zero", "single", "largest"])
async def test_what_is_written_is_served_and_read_back(gateway, weights):
    engine = await started(gateway)
    chat = pub("chat", *weights)
    result = await engine.apply({chat.key: chat})
    assert not result.rejected
    assert (await served(gateway))[chat.key] == chat.route
    await engine.aclose()


async def test_read_back_after_a_restart_writes_nothing(gateway):
    engine = await started(gateway)
    pubs = {p.key: p for p in (pub("a", 1, 2), pub("b", 0, 3))}
    await engine.apply(pubs)
    await engine.aclose()
    restarted = await started(gateway)
    assert dict(restarted.confirmed) == {key: p.route for key, p in pubs.items()}
    result = await restarted.apply(pubs)
    assert not result.wrote
    await restarted.aclose()


async def test_a_generation_only_change_writes_nothing(gateway):
    engine = await started(gateway)
    await engine.apply({pub("a", 1, 2).key: pub("a", 1, 2)})
    result = await engine.apply({pub("a", 1, 2).key: pub("a", 1, 2, generation=9)})
    assert not result.wrote
    await engine.aclose()


async def test_two_maps_with_one_hostname(gateway):
    engine = await started(gateway)
    owner = pub("a", 1, host="shared.example.com", created="2026-01-01T00:00:00Z")
    other = pub("b", 1, host="shared.example.com", created="2026-02-01T00:00:00Z")
    result = await engine.apply({other.key: other, owner.key: owner})
    assert result.rejected[other.key].reason == Reason.HOST_CONFLICT
    assert set(await served(gateway)) == {owner.key}
    await engine.aclose()


@pytest.mark.parametrize("maps", [2, 3], ids=["swap", "rotation"])
async def test_maps_that_pass_their_hostnames_round_all_get_the_new_ones(gateway, maps):
    # Each claim waited for its owner's move, which waited for the next claim: every map of a swap
    # (a blue/green by hostname) waited as HostConflict for ever. The youngest now gives its
    # hostname up first, and no write serves a hostname for two maps.
    engine = await started(gateway)
    names = [f"m{i}" for i in range(maps)]
    created = [f"2026-0{i + 1}-01T00:00:00Z" for i in range(maps)]
    before = {pub(n, 1, host=f"h{i}.example.com", created=c) for i, (n, c) in enumerate(zip(names, created))}
    assert not (await engine.apply({p.key: p for p in before})).rejected
    after = {pub(n, 2, host=f"h{(i + 1) % maps}.example.com", created=c) for i, (n, c) in enumerate(zip(names, created))}
    result = await engine.apply({p.key: p for p in after})
    assert not result.rejected
    assert {key: route.hostname for key, route in (await served(gateway)).items()} == {p.key: p.route.hostname for p in after}
    assert dict(engine.confirmed) == {p.key: p.route for p in after}
    await engine.aclose()


async def test_withdrawal_leaves_the_others(gateway):
    engine = await started(gateway)
    await engine.apply({p.key: p for p in (pub("a", 1), pub("b", 2))})
    await engine.apply({MapKey("prod", "a"): None})
    assert set(await served(gateway)) == {MapKey("prod", "b")}
    await engine.aclose()


async def test_a_read_back_in_pages_finds_what_the_whole_read_finds(gateway):
    """Issue 29: a resync reads a gateway that can be read a map at a time (--json-dir, Envoy over
    xDS) a page at a time; the pages and what else it serves are what the whole read gives, and
    nothing drifted. A gateway read whole is read whole by the first page."""
    engine = await started(gateway)
    pubs = {p.key: p for p in (pub("a", 1, 2), pub("b", 0, 3), pub("c", 4))}
    await engine.apply(pubs)
    keys = sorted(pubs)
    if isinstance(engine.transport, PagedRead):
        paged = {**await engine.transport.read_page(keys[:2]), **await engine.transport.read_page(keys[2:]),
                 **await engine.transport.read_others(keys[:1])}
        assert paged == await engine.transport.read() == {key: p.route for key, p in pubs.items()}
    for index, key in enumerate(keys):
        done = await engine.reconcile_page([key], last=index == len(keys) - 1)
        assert not done.repaired and not done.refused
    await engine.aclose()


# --- xDS: a gateway of several clients (scripted delta-ADS clients over gRPC on 127.0.0.1) -------


@contextlib.asynccontextmanager
async def xds_engine(*, ack_timeout: float = 60.0) -> AsyncIterator[tuple[Engine[Any], int]]:
    """An xDS engine serving on a free port. The ACK timeout is long, so a write that waits it
    out instead of being released fails the test's own bound."""
    port = free_port()
    engine = ADAPTERS["envoy"].engine("envoy", EnvoyOptions(envoy_xds_listen=f"127.0.0.1:{port}"))
    engine.transport.ack_timeout = ack_timeout
    engine.transport.read_wait = 5.0
    serving = asyncio.create_task(engine.serve())
    try:
        await asyncio.wait_for(engine.transport.started(), 10)
        yield engine, port
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.aclose()


@contextlib.asynccontextmanager
async def scripted(engine: Engine[Any], *envoys: ScriptedEnvoy) -> AsyncIterator[None]:
    """`envoys` connected, each one's stream taken by the engine's server: a read before the last
    stream arrives reads the others alone (a loaded machine made that race real)."""
    before = len(engine.transport.envoys())
    try:
        for envoy in envoys:
            await envoy.connect()
        await eventually(lambda: len(engine.transport.envoys()) == before + len(envoys), timeout=10)
        yield
    finally:
        for envoy in envoys:
            await envoy.leave()


async def test_xds_two_clients_that_disagree_at_restart_keep_the_map_and_converge_on_the_engines_write():
    older, newer = pub("chat", 1), pub("chat", 1, 2)
    renderer = XdsRenderer()
    async with xds_engine() as (engine, port):
        envoys = [ScriptedEnvoy(port, "behind", held=holding([renderer.render(older.key, older.route)])),
                  ScriptedEnvoy(port, "ahead", held=holding([renderer.render(newer.key, newer.route)]))]
        async with scripted(engine, *envoys):
            assert dict(await engine.start()) == {newer.key: newer.route}  # a tie: the first by name
            latest = pub("chat", 3, 1)
            result = await engine.apply({latest.key: latest})
            assert not result.rejected and result.wrote
            assert [e.serves(latest.key) for e in envoys] == [latest.route, latest.route]


async def test_xds_a_client_that_leaves_mid_write_releases_it():
    chat = pub("chat", 1)
    async with xds_engine() as (engine, port):
        stays, leaves = ScriptedEnvoy(port, "stays"), ScriptedEnvoy(port, "leaves")
        async with scripted(engine, stays, leaves):
            await engine.start()
            leaves.answering.clear()
            applying = asyncio.create_task(engine.apply({chat.key: chat}))
            await eventually(lambda: leaves.responses, timeout=10)
            await leaves.leave()
            assert not (await asyncio.wait_for(applying, 20)).rejected
            assert engine.confirmed == {chat.key: chat.route} and stays.serves(chat.key) == chat.route
            # The last one leaving mid-write: nobody acknowledged it, so the outcome is unknown.
            stays.answering.clear()
            moved = pub("chat", 0, 1)
            applying = asyncio.create_task(engine.apply({moved.key: moved}))
            await eventually(lambda: len(stays.responses) > 1, timeout=10)
            await stays.leave()
            with pytest.raises(Unavailable):
                await asyncio.wait_for(applying, 20)


async def test_xds_a_late_clients_refusal_is_reported():
    chat = pub("chat", 1)
    async with xds_engine() as (engine, port):
        first = ScriptedEnvoy(port, "first")
        async with scripted(engine, first):
            await engine.start()
            assert not (await engine.apply({chat.key: chat})).rejected
            async with scripted(engine, ScriptedEnvoy(port, "late", refuse=refuse_clusters_of(chat.key, "cannot take it"))):
                refusals = await eventually(engine.transport.refusals, timeout=10)
            assert refusals == {chat.key: "envoy late refused the cluster: cannot take it"}
