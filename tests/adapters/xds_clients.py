"""Scripted delta-ADS clients: what an Envoy does on the wire (subscribe to clusters and scopes,
then to each scope's route configuration; ACK or NACK each response; list what it holds when it
reconnects), over real gRPC on 127.0.0.1, with its answers under the test's control: refuse what
`refuse` names, hold every answer while `answering` is clear, leave at any moment."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, SCOPE_TYPE, MapResources, map_name, served_route
from publisher.core.values import MapKey, Route

TYPES = (CLUSTER_TYPE, SCOPE_TYPE, ROUTE_TYPE)
# type_url, the names a response adds or removes -> the NACK's error text, or None to ACK it.
# (type_url, resource name -> version, None for a removal) -> the error to NACK with, or None.
Refuse = Callable[[str, dict[str, str | None]], str | None]


def holding(parts: Iterable[MapResources]) -> dict[str, dict[str, str]]:
    """What an Envoy that ACKed `parts` holds: type_url -> resource name -> version."""
    held: dict[str, dict[str, str]] = {type_url: {} for type_url in TYPES}
    for part in parts:
        held[CLUSTER_TYPE].update((r.name, r.version) for r in part.clusters)
        held[SCOPE_TYPE][part.scope.name] = part.scope.version
        held[ROUTE_TYPE][part.route_config.name] = part.route_config.version
    return held


def refuse_clusters_of(key: MapKey, error: str = "scripted refusal") -> Refuse:
    return lambda type_url, names: error if type_url == CLUSTER_TYPE and map_name(key) in names else None


@dataclass(eq=False)
class ScriptedEnvoy:
    """One delta-ADS client. `held` survives `leave()`, so `connect()` again is an Envoy that
    reconnects and lists what it holds; a new ScriptedEnvoy is one that comes back empty."""

    port: int
    node: str = "scripted"
    held: dict[str, dict[str, str]] = field(default_factory=lambda: {type_url: {} for type_url in TYPES})
    refuse: Refuse = lambda type_url, names: None
    answering: asyncio.Event = field(default_factory=asyncio.Event)
    # Every response received, and the error text of each NACK sent.
    responses: list[discovery_pb2.DeltaDiscoveryResponse] = field(default_factory=list)
    nacked: list[str] = field(default_factory=list)
    _requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None] | None = None
    _channel: grpc.aio.Channel | None = None
    _pump: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.answering.set()

    @property
    def connected(self) -> bool:
        return self._pump is not None and not self._pump.done()

    async def connect(self) -> None:
        # A connection of its own, as a separate Envoy process has (gRPC shares one by default).
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}", options=[("grpc.use_local_subchannel_pool", 1)])
        self._requests = asyncio.Queue()
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel).DeltaAggregatedResources(self._outgoing(self._requests))
        self._send(discovery_pb2.DeltaDiscoveryRequest(
            node=base_pb2.Node(id=self.node), type_url=CLUSTER_TYPE, initial_resource_versions=self.held[CLUSTER_TYPE]))
        self._send(discovery_pb2.DeltaDiscoveryRequest(type_url=SCOPE_TYPE, initial_resource_versions=self.held[SCOPE_TYPE]))
        if self.held[SCOPE_TYPE]:
            self._send(discovery_pb2.DeltaDiscoveryRequest(
                type_url=ROUTE_TYPE, resource_names_subscribe=sorted(self.held[SCOPE_TYPE]), initial_resource_versions=self.held[ROUTE_TYPE]))
        self._pump = asyncio.create_task(self._answer(call))

    async def leave(self) -> None:
        """Close the stream as a stopped Envoy does: at once, whatever is in flight."""
        if self._requests is not None:
            self._requests.put_nowait(None)
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        self._pump = self._channel = self._requests = None

    def serves(self, key: MapKey) -> Route | None:
        """The route it serves for `key`: scope, route configuration and the map's cluster it routes to."""
        if map_name(key) not in self.held[SCOPE_TYPE]:
            return None
        return served_route(self.held[CLUSTER_TYPE].get(map_name(key)), self.held[ROUTE_TYPE].get(map_name(key)))

    def clusters(self, key: MapKey) -> set[str]:
        """The map's clusters it holds: its own, and any of an older sidecar's clusters per backend."""
        prefix = f"{map_name(key)}|"
        return {name for name in self.held[CLUSTER_TYPE] if name == map_name(key) or name.startswith(prefix)}

    # --- the wire -------------------------------------------------------------------------------

    @staticmethod
    async def _outgoing(requests: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None]) -> AsyncIterator[discovery_pb2.DeltaDiscoveryRequest]:
        while (request := await requests.get()) is not None:
            yield request

    def _send(self, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        assert self._requests is not None
        self._requests.put_nowait(request)

    async def _answer(self, call: grpc.aio.StreamStreamCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for response in call:
                self.responses.append(response)
                await self.answering.wait()
                self._apply(response)

    def _apply(self, response: discovery_pb2.DeltaDiscoveryResponse) -> None:
        type_url = response.type_url
        versions: dict[str, str | None] = {r.name: r.version for r in response.resources}
        versions.update(dict.fromkeys(response.removed_resources))
        error = self.refuse(type_url, versions)
        if error is not None:
            self.nacked.append(error)
            self._send(discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url, response_nonce=response.nonce, error_detail=status_pb2.Status(code=3, message=error)))
            return
        held = self.held[type_url]
        added = [r.name for r in response.resources if r.name not in held]
        held.update((r.name, r.version) for r in response.resources)
        for name in response.removed_resources:
            held.pop(name, None)
        self._send(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, response_nonce=response.nonce))
        if type_url == SCOPE_TYPE:
            # As Envoy does: a new scope subscribes its route configuration, a removed one drops it.
            removed = list(response.removed_resources)
            for name in removed:
                self.held[ROUTE_TYPE].pop(name, None)
            if added or removed:
                self._send(discovery_pb2.DeltaDiscoveryRequest(
                    type_url=ROUTE_TYPE, resource_names_subscribe=added, resource_names_unsubscribe=removed))
