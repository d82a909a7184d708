"""The xDS transport's promises with several clients, against scripted delta-ADS clients over real
gRPC on 127.0.0.1 (tests/adapters/xds_clients.py), where the test needs ACK and NACK timing in hand:
confirmed means acknowledged, nothing leaves an Envoy unless the engine asked, every refusal is
reported, a second sidecar cannot share the address, and the `envoy` label survives a reconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest

from adapters.base import NotConnected, Unavailable
from adapters.envoy.resources import MapResources, XdsRenderer
from adapters.envoy.xds import XdsTransport
from publisher import metrics
from publisher.core.values import Backend, MapKey, Route
from tests.adapters.test_envoy_xds import xds_server
from tests.adapters.xds_clients import ScriptedEnvoy, holding, refuse_clusters_of
from tests.gateways import eventually, free_port

RENDERER = XdsRenderer()
CHAT, EMBED = MapKey("prod", "chat"), MapKey("prod", "embed")


def route(host: str, **weights: int) -> Route:
    return Route(host, tuple(Backend(name, f"http://{name}.example:8080", weight) for name, weight in weights.items()))


def part(key: MapKey, r: Route) -> MapResources:
    return RENDERER.render(key, r)


def transport_on(listen: str = "127.0.0.1:0", *, ack_timeout: float = 60.0) -> contextlib.AbstractAsyncContextManager[XdsTransport]:
    """A serving transport. The ACK timeout is long, so a write that waits it out (instead of
    being released by an Envoy that left) fails the test's own bound instead of passing late."""
    return xds_server(listen, ack_timeout=ack_timeout)


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


# --- 3. confirmed means acknowledged ------------------------------------------------------------


async def test_a_write_with_no_envoy_connected_raises_not_connected():
    """Finding 7: before any Envoy connects the write is NotConnected (the maps stay pending),
    not the failure it was ("no Envoy connected" as Unavailable, every map ApplyFailed)."""
    async with transport_on() as transport:
        with pytest.raises(NotConnected):
            await transport.write({CHAT: part(CHAT, route("chat.example.com", a=1))}, {CHAT: part(CHAT, route("chat.example.com", a=1))})


async def test_a_write_whose_only_envoy_leaves_before_it_acks_is_unavailable_at_once():
    """Finding 3: the pending ACK was never failed, so the write waited out the ACK timeout and
    then returned a clean result: Published with no Envoy having ACKed it."""
    async with transport_on() as transport:
        only = ScriptedEnvoy(transport.port, "only")
        async with clients(only):
            await connected(transport, 1)
            only.answering.clear()
            chat = part(CHAT, route("chat.example.com", a=1))
            write = asyncio.create_task(transport.write({CHAT: chat}, {CHAT: chat}))
            await eventually(lambda: only.responses, timeout=10)
            await only.leave()
            with pytest.raises(Unavailable) as raised:
                await asyncio.wait_for(write, 20)
            assert not isinstance(raised.value, NotConnected)  # one was connected: the outcome is unknown


async def test_an_envoy_that_leaves_mid_write_releases_it_and_the_others_confirm():
    async with transport_on() as transport:
        stays, leaves = ScriptedEnvoy(transport.port, "stays"), ScriptedEnvoy(transport.port, "leaves")
        async with clients(stays, leaves):
            await connected(transport, 2)
            leaves.answering.clear()
            chat = part(CHAT, route("chat.example.com", a=1))
            write = asyncio.create_task(transport.write({CHAT: chat}, {CHAT: chat}))
            await eventually(lambda: leaves.responses, timeout=10)
            await leaves.leave()
            result = await asyncio.wait_for(write, 20)
            assert result.rejected == {}
            assert stays.serves(CHAT) == route("chat.example.com", a=1)


def serving_streams() -> list[asyncio.Task[object]]:
    """The server side of the streams: gRPC's tasks running handlers, and the sessions' own."""
    return [
        t for t in asyncio.all_tasks()
        if not t.done() and (t.get_name() == "rpc_task" or t.get_name().startswith("HandleExceptions[") or "Session." in t.get_coro().__qualname__)
    ]


async def test_a_stopped_server_leaves_no_stream_behind():
    """CI found a test's teardown with gRPC's stream handlers still unwinding: gRPC's stop returns
    once its core has shut down, before the handlers it cancelled (and the sessions detaching in
    them) have ended. The stop now waits for them: nothing of the server's runs after it."""
    async with transport_on() as transport:
        envoys = [ScriptedEnvoy(transport.port, f"envoy-{i}", held=holding([part(CHAT, route("chat.example.com", a=1))])) for i in range(3)]
        async with clients(*envoys):
            await connected(transport, 3)
            assert await transport.read() == {CHAT: route("chat.example.com", a=1)}
            assert len(serving_streams()) >= 3  # what the assertion below counts exists
            await transport.aclose()
            assert serving_streams() == []


async def test_envoys_are_read_a_page_of_maps_at_a_time_and_what_else_they_serve():
    """Issue 29: a resync read every map every Envoy holds in one go (100-170 ms of the applier at
    10,000 maps, a change waiting behind it). A page counts the votes of its maps alone; what the
    Envoys serve besides the engine's maps is read apart, once a resync."""
    stray = MapKey("prod", "stray")
    chat, embed = route("chat.example.com", a=1), route("embed.example.com", b=2)
    async with transport_on() as transport:
        envoys = [ScriptedEnvoy(transport.port, f"envoy-{i}", held=holding([part(CHAT, chat), part(EMBED, embed)] + ([part(stray, route("stray.example.com", c=1))] if i == 0 else [])))
                  for i in range(2)]
        async with clients(*envoys):
            await connected(transport, 2)
            assert await transport.read_page([CHAT]) == {CHAT: chat}  # before any read: read whole, which makes the target
            assert await transport.read_page([EMBED, MapKey("prod", "absent")]) == {EMBED: embed}
            assert await transport.read_others([CHAT, EMBED]) == {stray: route("stray.example.com", c=1)}
            assert await transport.read_others([CHAT, EMBED, stray]) == {}


# --- 2. nothing leaves a gateway unless the engine asked ----------------------------------------


async def test_a_restarted_sidecar_reads_a_map_envoys_disagree_on_as_most_of_them_serve_it():
    """Finding 2: read() kept only maps every Envoy served alike, made that the target, and the
    first convergence then removed the map from every Envoy, though the engine never asked."""
    old, new = route("chat.example.com", a=1), route("chat.example.com", a=1, b=1)
    async with transport_on() as transport:
        envoys = [ScriptedEnvoy(transport.port, f"envoy-{i}", held=holding([part(CHAT, r)])) for i, r in enumerate((new, new, old))]
        async with clients(*envoys):
            await connected(transport, 3)
            assert await transport.read() == {CHAT: new}
            # The one an update behind is brought to what the read reported; nothing is removed.
            await eventually(lambda: all(e.serves(CHAT) == new for e in envoys), timeout=10)
            newer = part(CHAT, route("chat.example.com", b=1))
            assert (await transport.write({CHAT: newer}, {CHAT: newer})).rejected == {}
            assert all(e.serves(CHAT) == route("chat.example.com", b=1) for e in envoys)


async def test_a_leftover_cluster_of_an_interrupted_update_is_no_reason_to_drop_the_map():
    served = route("chat.example.com", a=1)
    held = holding([part(CHAT, served)])
    # Left over: a cluster per backend, as a sidecar of before one cluster per map named them.
    held["type.googleapis.com/envoy.config.cluster.v3.Cluster"]["ome|prod|chat|old"] = "1"
    async with transport_on() as transport:
        envoy = ScriptedEnvoy(transport.port, "envoy", held=held)
        async with clients(envoy):
            await connected(transport, 1)
            assert await transport.read() == {CHAT: served}
            await eventually(lambda: envoy.clusters(CHAT) == {"ome|prod|chat"}, timeout=10)
            assert envoy.serves(CHAT) == served


async def test_what_a_late_envoy_lists_stays_until_the_engine_withdraws_it():
    """A sidecar that read nothing (no Envoy within read_wait) wrote its first map; the Envoy that
    connected then lost every map it listed, though the engine had asked for none of that."""
    kept = route("embed.example.com", a=1)
    async with transport_on() as transport:
        transport.read_wait = 0.05
        assert await transport.read() == {}
        late = ScriptedEnvoy(transport.port, "late", held=holding([part(EMBED, kept)]))
        async with clients(late):
            await connected(transport, 1)
            chat = part(CHAT, route("chat.example.com", a=1))
            assert (await transport.write({CHAT: chat}, {CHAT: chat})).rejected == {}
            assert late.serves(CHAT) == route("chat.example.com", a=1)
            assert late.serves(EMBED) == kept
            assert (await transport.write({CHAT: chat}, {EMBED: None})).rejected == {}
            assert late.serves(EMBED) is None and late.clusters(EMBED) == set()


# --- 4. every refusal is reported ---------------------------------------------------------------


async def test_a_late_envoys_refusal_is_reported_once_and_not_resent_to_it():
    """Finding 4: an Envoy that connected after the write and NACKed the map left it Published;
    the refusal was dropped, and every resync resent the map and got the NACK back."""
    chat = part(CHAT, route("chat.example.com", a=1))
    async with transport_on() as transport:
        first = ScriptedEnvoy(transport.port, "first")
        async with clients(first):
            await connected(transport, 1)
            assert (await transport.write({CHAT: chat}, {CHAT: chat})).rejected == {}
            assert transport.refusals() == {}
            strict = ScriptedEnvoy(transport.port, "strict", refuse=refuse_clusters_of(CHAT, "no TLS here"))
            async with clients(strict):
                refusals = await eventually(transport.refusals, timeout=10)
                assert set(refusals) == {CHAT}
                assert "envoy strict refused the cluster: no TLS here" in refusals[CHAT]
                assert transport.refusals() == {}  # drained
                sent = len(strict.responses)
                assert await transport.read() == {CHAT: route("chat.example.com", a=1)}
                assert len(strict.responses) == sent and transport.refusals() == {}


async def test_a_refusal_within_a_write_is_the_writes_not_a_late_one():
    chat = part(CHAT, route("chat.example.com", a=1))
    async with transport_on() as transport:
        strict = ScriptedEnvoy(transport.port, "strict", refuse=refuse_clusters_of(CHAT))
        async with clients(strict):
            await connected(transport, 1)
            result = await transport.write({CHAT: chat}, {CHAT: chat})
            assert set(result.rejected) == {CHAT} and "envoy strict refused the cluster" in result.rejected[CHAT]
            assert transport.refusals() == {}


THIRD = MapKey("prod", "third")


def paused_after_its_batch_refusal(envoy: ScriptedEnvoy, key: MapKey) -> list[int]:
    """Make `envoy` refuse `key`'s cluster and stop answering right after it refused a batch
    (before the server, taking the batch's maps one by one, learns which map it refuses); the
    list gets the count of responses it had received then."""
    refuse, paused = refuse_clusters_of(key), []

    def refuse_then_pause(type_url, names):
        error = refuse(type_url, names)
        if error is not None and len(names) > 1:
            envoy.answering.clear()
            paused.append(len(envoy.responses))
        return error

    envoy.refuse = refuse_then_pause
    return paused


async def test_a_write_waits_for_a_refusing_envoy_to_pin_its_refusal_once_the_others_converged():
    """CI found a busy machine's write stop waiting for the Envoy that refused a batch as soon as
    the other converged: the map it refuses was reported "not acknowledged" instead of refused in
    its words, and the maps it would take as held back. The write now waits for it to take the
    batch's maps one by one (at most `refusal_wait`)."""
    batch = {key: part(key, route(f"{key.name}.example.com", a=1)) for key in (CHAT, EMBED, THIRD)}
    async with transport_on() as transport:
        transport.refusal_wait = 60.0  # far beyond the test's own bounds: the wait ends as it finishes
        lenient, strict = ScriptedEnvoy(transport.port, "lenient"), ScriptedEnvoy(transport.port, "strict")
        paused = paused_after_its_batch_refusal(strict, CHAT)
        async with clients(lenient, strict):
            await connected(transport, 2)
            write = asyncio.create_task(transport.write(batch, batch))
            # The lenient one converged as the server sees it, the strict one holds the first map
            # sent alone.
            await eventually(lambda: all(transport.served(key).get("lenient") for key in batch), timeout=10)
            await eventually(lambda: paused and len(strict.responses) > paused[0], timeout=10)
            assert not write.done()
            strict.answering.set()
            result = await asyncio.wait_for(write, 20)
            assert result.rejected == {} and set(result.held_back) == {CHAT}
            assert "envoy strict refused the cluster: scripted refusal" in result.held_back[CHAT]
            assert strict.serves(EMBED) == route("embed.example.com", a=1) and strict.serves(THIRD) == route("third.example.com", a=1)


async def test_a_refusing_envoy_that_stops_answering_holds_the_write_at_most_the_refusal_wait():
    batch = {key: part(key, route(f"{key.name}.example.com", a=1)) for key in (CHAT, EMBED, THIRD)}
    async with transport_on() as transport:
        transport.refusal_wait = 0.2
        lenient, strict = ScriptedEnvoy(transport.port, "lenient"), ScriptedEnvoy(transport.port, "strict")
        paused_after_its_batch_refusal(strict, CHAT)
        async with clients(lenient, strict):
            await connected(transport, 2)
            # The ACK timeout is 60 s: the write returns long before it, the Envoy still silent.
            result = await asyncio.wait_for(transport.write(batch, batch), 20)
            assert not strict.answering.is_set()
            assert result.rejected == {} and set(result.held_back) == set(batch)
            assert all("has not acknowledged" in why for why in result.held_back.values())
            assert all(lenient.serves(key) == route(f"{key.name}.example.com", a=1) for key in batch)


# --- 7. one sidecar per address -----------------------------------------------------------------


async def test_a_second_sidecar_on_the_same_xds_address_cannot_bind_it():
    """Finding 7: gRPC sets SO_REUSEPORT, so a second sidecar bound the address too and Envoys
    split between the two."""
    listen = f"127.0.0.1:{free_port()}"
    async with transport_on(listen):
        second = XdsTransport(listen, RENDERER)
        with pytest.raises(OSError) as raised:
            await asyncio.wait_for(second.serve(), 10)
        assert raised.value.filename == "--envoy-xds-listen"
        assert raised.value.strerror == f"cannot listen on {listen}: Address already in use"


# --- issue 23 point 6: the envoy label --------------------------------------------------------------


def _envoy_labels() -> set[str]:
    lines = generate_latest(metrics.REGISTRY).decode().splitlines()
    return {line.split('envoy="', 1)[1].split('"', 1)[0] for line in lines if line.startswith(metrics.PREFIX + "xds_") and 'envoy="' in line}


async def test_the_envoy_label_is_the_node_id_and_a_reconnect_makes_no_new_series():
    async with transport_on() as transport:
        metrics.watch_envoys(transport)
        try:
            envoy = ScriptedEnvoy(transport.port, "gateway-0")
            async with clients(envoy):
                await connected(transport, 1)
                assert _envoy_labels() == {"gateway-0"}
                await envoy.leave()
                await connected(transport, 0)
                await envoy.connect()  # from a new ephemeral port
                await connected(transport, 1)
                assert _envoy_labels() == {"gateway-0"}
                twin = ScriptedEnvoy(transport.port, "gateway-0")
                async with clients(twin):
                    await connected(transport, 2)
                    # Two Envoys with one node id on one host: told apart by their ports.
                    labels = _envoy_labels()
                    assert len(labels) == 2 and all(label.startswith("gateway-0@127.0.0.1:") for label in labels)
        finally:
            metrics.watch_envoys(None)


async def test_a_cancelled_server_ends_its_streams_and_frees_its_address():
    """Cancelling gRPC's wait_for_termination cancelled the server's graceful stop: the stopped
    sidecar kept its Envoys' streams and its port, so a restart on the address (no SO_REUSEPORT
    now) could not bind it."""
    listen = f"127.0.0.1:{free_port()}"
    transport = XdsTransport(listen, RENDERER)
    serving = asyncio.create_task(transport.serve())
    await asyncio.wait_for(transport.started(), 10)
    envoy = ScriptedEnvoy(transport.port, "envoy")
    async with clients(envoy):
        await connected(transport, 1)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.aclose()
        await eventually(lambda: not envoy.connected, timeout=10)
    async with transport_on(listen) as restarted:
        assert restarted.port == int(listen.rsplit(":", 1)[1])
