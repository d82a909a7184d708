"""Issue 30: many clients, one truth per client; bounded per-client state. Against scripted
delta-ADS clients over real gRPC on 127.0.0.1 (tests/adapters/xds_clients.py):

- a client that refuses every update holds back only its own weights: the others get each change
  and confirm it, the write names the refuser and its words, and the map is not published (the
  engine writes it again) until every client took it;
- a refusing client never holds a write back beyond what the others need;
- a stream that lists or subscribes more names than the cap is ended with RESOURCE_EXHAUSTED, and
  nothing kept for a stream outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import generate_latest

from adapters.engine import Engine
from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, MapResources, XdsRenderer
from adapters.envoy.xds import XdsTransport
from adapters.envoy.xds_plan import WORDS_CHARS
from publisher import metrics
from publisher.core.values import Backend, MapKey, Publication, Reason, Route
from tests.adapters.test_envoy_xds import xds_server
from tests.adapters.xds_clients import ScriptedEnvoy
from tests.gateways import eventually

RENDERER = XdsRenderer()
CHAT, EMBED = MapKey("prod", "chat"), MapKey("prod", "embed")


def route(host: str, **weights: int) -> Route:
    return Route(host, tuple(Backend(name, f"http://{name}.example:8080", weight) for name, weight in weights.items()))


def part(key: MapKey, r: Route) -> MapResources:
    return RENDERER.render(key, r)


def refuse_everything(type_url: str, names: list[str]) -> str | None:
    return f"rogue refuses {len(names)} {type_url.rsplit('.', 1)[1]}s " + "x" * 1000 if names else None


@contextlib.asynccontextmanager
async def clients(*envoys: ScriptedEnvoy) -> AsyncIterator[tuple[ScriptedEnvoy, ...]]:
    try:
        for envoy in envoys:
            await envoy.connect()
        yield envoys
    finally:
        for envoy in envoys:
            await envoy.leave()


async def connected(transport: XdsTransport, count: int) -> None:
    await eventually(lambda: len(transport.envoys()) == count, timeout=10)


def _refused_series() -> dict[str, str]:
    lines = generate_latest(metrics.REGISTRY).decode().splitlines()
    prefix = metrics.PREFIX + "xds_maps_refused{"
    return {line.split('envoy="', 1)[1].split('"', 1)[0]: line.rsplit(" ", 1)[1] for line in lines if line.startswith(prefix)}


# --- many clients, one truth per client ------------------------------------------------------------


async def test_a_client_refusing_every_update_holds_back_only_its_own_weights():
    """Issue 30: a rogue NACKing everything made every map ApplyFailed and put back for all, so a
    real Envoy kept a changed map's old split until the rogue left (36 s)."""
    first, second = route("chat.example.com", a=1, b=1), route("chat.example.com", a=3, b=1)
    async with xds_server(ack_timeout=60.0) as transport:
        metrics.watch_envoys(transport)
        try:
            good = [ScriptedEnvoy(transport.port, f"good-{i}") for i in range(2)]
            rogue = ScriptedEnvoy(transport.port, "rogue", refuse=refuse_everything)
            async with clients(*good, rogue):
                await connected(transport, 3)
                for weights in (first, second):
                    result = await asyncio.wait_for(transport.write({CHAT: part(CHAT, weights)}, {CHAT: part(CHAT, weights)}), 10)
                    assert result.rejected == {}
                    assert all(envoy.serves(CHAT) == weights for envoy in good)  # the others got the change
                    assert rogue.serves(CHAT) is None
                    (message,) = result.held_back.values()
                    assert message.startswith("envoy rogue refused the cluster: rogue refuses 1 Clusters xxx")
                    assert message.endswith("held back on those; 2 other Envoys serve it")
                    assert len(message) < WORDS_CHARS + 120  # Envoy's words, bounded
                statuses = {status.name: status for status in transport.envoys()}
                assert {name: status.refused for name, status in statuses.items()} == {"good-0": 0, "good-1": 0, "rogue": 1}
                assert _refused_series() == {"good-0": "0.0", "good-1": "0.0", "rogue": "1.0"}
                served = transport.served(CHAT)
                assert served["good-0"] == served["good-1"] is not None  # the version naming the second weights
                assert served["rogue"].startswith("nothing, holding back the current weights: envoy rogue refused the cluster")
                # What the others serve is what the sidecar reads back: the rogue has no vote on it.
                assert await transport.read() == {CHAT: second}
                await rogue.leave()
                await connected(transport, 2)
                assert _refused_series() == {"good-0": "0.0", "good-1": "0.0"}  # its series left with it
        finally:
            metrics.watch_envoys(None)


async def test_a_refusing_client_never_holds_a_write_back_beyond_what_the_others_need():
    """A first publish of 50 maps: the rogue NACKs the batch, then answers nothing more (each of
    its answers could take the whole ACK timeout). The write returns once the good client took
    everything; the maps the rogue did not answer for are not acknowledged by it, and say so."""
    maps = {MapKey("prod", f"m{i}"): part(MapKey("prod", f"m{i}"), route(f"m{i}.example.com", a=1)) for i in range(50)}
    async with xds_server(ack_timeout=60.0) as transport:
        good = ScriptedEnvoy(transport.port, "good")

        def refuse_then_stall(type_url: str, names: list[str]) -> str | None:
            if names:
                rogue.answering.clear()
                return "no"
            return None

        rogue = ScriptedEnvoy(transport.port, "rogue", refuse=refuse_then_stall)
        async with clients(good, rogue):
            await connected(transport, 2)
            result = await asyncio.wait_for(transport.write(maps, maps), 10)
            assert result.rejected == {}
            assert set(result.held_back) == set(maps)
            assert all(message == "envoy rogue has not acknowledged it (it refuses other maps); held back on those; 1 other Envoy serves it"
                       for message in result.held_back.values())
            assert all(good.serves(key) == maps[key].route for key in maps)
            # The next change is the good client's as promptly, while the rogue still stalls.
            changed = part(CHAT, route("chat.example.com", a=2))
            result = await asyncio.wait_for(transport.write({**maps, CHAT: changed}, {CHAT: changed}), 10)
            assert good.serves(CHAT) == changed.route and set(result.held_back) == {CHAT}
            rogue.answering.set()


async def test_a_hostname_move_one_client_refuses_is_put_back_for_all():
    """The engine hands a hostname to another map once the move away from it is confirmed: a move
    some Envoy refuses would leave that Envoy serving the hostname for the old map, so it is
    refused for the whole fleet, as before."""
    old, moved = route("chat.example.com", a=1), route("talk.example.com", a=1)
    async with xds_server(ack_timeout=60.0) as transport:
        good = ScriptedEnvoy(transport.port, "good")
        picky = ScriptedEnvoy(transport.port, "picky")
        async with clients(good, picky):
            await connected(transport, 2)
            assert (await transport.write({CHAT: part(CHAT, old)}, {CHAT: part(CHAT, old)})).rejected == {}
            picky.refuse = refuse_everything
            result = await asyncio.wait_for(transport.write({CHAT: part(CHAT, moved)}, {CHAT: part(CHAT, moved)}), 10)
            assert set(result.rejected) == {CHAT} and result.held_back == {}
            assert good.serves(CHAT) == old and picky.serves(CHAT) == old


def _publication(key: MapKey, r: Route, generation: int) -> Publication:
    return Publication(key.namespace, key.name, r.hostname, generation, generation, r.backends)


async def test_the_engine_confirms_a_held_back_map_reports_it_refused_and_publishes_it_once_every_client_took_it():
    first, second = route("chat.example.com", a=1, b=1), route("chat.example.com", a=3, b=1)
    async with xds_server(ack_timeout=60.0) as transport:
        engine = Engine("envoy", RENDERER, transport)
        good = ScriptedEnvoy(transport.port, "good")
        rogue = ScriptedEnvoy(transport.port, "rogue")
        async with clients(good, rogue):
            await connected(transport, 2)
            await engine.start()
            assert (await engine.apply({CHAT: _publication(CHAT, first, 1)})).rejected == {}
            rogue.refuse = refuse_everything
            result = await engine.apply({CHAT: _publication(CHAT, second, 2)})
            held = result.rejected[CHAT]
            assert held.reason == Reason.APPLY_FAILED and "envoy rogue refused the cluster" in held.message
            assert engine.confirmed[CHAT] == second and good.serves(CHAT) == second and rogue.serves(CHAT) == first
            assert (await engine.reconcile()).repaired == frozenset()  # what the good one serves is no drift
            await rogue.leave()
            await connected(transport, 1)
            # Its retry: every client connected now takes it.
            assert (await engine.apply({CHAT: _publication(CHAT, second, 2)})).rejected == {}


# --- bounded per-client state -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def raw_stream(port: int) -> AsyncIterator[tuple[asyncio.Queue, grpc.aio.StreamStreamCall]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        requests: asyncio.Queue = asyncio.Queue()

        async def outgoing():
            while (request := await requests.get()) is not None:
                yield request

        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(outgoing())
        try:
            yield requests, call
        finally:
            requests.put_nowait(None)
            call.cancel()


async def _ended(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        async for _ in call:
            pass
    return ended.value


@pytest.mark.parametrize("how", ["subscriptions", "initial-versions"])
async def test_a_stream_naming_more_than_the_cap_is_ended_with_resource_exhausted(how):
    """Issue 30: one client subscribed to 1.4 million names and the sidecar kept them all (RSS
    169 -> 761 MB). Past the cap the stream ends, naming the cap; the others are not touched."""
    async with xds_server(ack_timeout=60.0) as transport:
        transport.names_floor = 1000
        good = ScriptedEnvoy(transport.port, "good")
        async with clients(good), raw_stream(transport.port) as (requests, call):
            names = [f"ome|prod|m{i}" for i in range(1001)]
            await requests.put(discovery_pb2.DeltaDiscoveryRequest(node=base_pb2.Node(id="greedy"), type_url=CLUSTER_TYPE))
            await connected(transport, 2)
            if how == "subscriptions":
                await requests.put(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=names[:600]))
                await requests.put(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=names[600:]))
            else:
                await requests.put(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, initial_resource_versions=dict.fromkeys(names, "1")))
            ended = await asyncio.wait_for(_ended(call), 10)
            assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than 1000 route names" in ended.details() and "max(1000, 10 x maps)" in ended.details()
            await connected(transport, 1)
            assert [s.node for s in transport.envoys()] == ["good"]


async def test_the_cap_grows_with_the_maps_served():
    async with xds_server() as transport:
        transport.names_floor = 10
        assert transport.names_cap() == 10
        transport._target = {MapKey("prod", f"m{i}"): part(CHAT, route("chat.example.com", a=1)) for i in range(3)}
        assert transport.names_cap() == 30


async def test_nothing_kept_for_a_stream_outlives_it():
    """Everything a stream kept (what it subscribed and listed, its refusals) is the session's,
    which nothing references once the stream ended."""
    chat = part(CHAT, route("chat.example.com", a=1))
    async with xds_server(ack_timeout=60.0) as transport:
        good = ScriptedEnvoy(transport.port, "good")
        rogue = ScriptedEnvoy(transport.port, "rogue", refuse=refuse_everything)
        async with clients(good, rogue):
            await connected(transport, 2)
            await transport.write({CHAT: chat}, {CHAT: chat})
            (session,) = [s for s in transport._sessions if s.node == "rogue"]
            assert session.state.refused and session.state.subscribed
            kept = weakref.ref(session)
            del session
            await rogue.leave()
            await connected(transport, 1)
            await eventually(lambda: (gc.collect(), kept() is None)[1], timeout=10)
            assert transport.refusals() == {}  # its refusal of the write was the write's, not kept behind it


async def test_a_refusal_is_a_rejection_when_the_only_client_refuses():
    chat = part(CHAT, route("chat.example.com", a=1))
    async with xds_server(ack_timeout=60.0) as transport:
        rogue = ScriptedEnvoy(transport.port, "rogue", refuse=refuse_everything)
        async with clients(rogue):
            await connected(transport, 1)
            result = await transport.write({CHAT: chat}, {CHAT: chat})
            assert set(result.rejected) == {CHAT} and result.held_back == {}
            assert "envoy rogue refused the cluster" in result.rejected[CHAT]
