"""What every gRPC server the sidecar runs for its gateways shares: the server options, binding
with a readable refusal, naming a client by its node id and peer, and waiting for its stream
handlers when it stops."""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc

from adapters.listen import bind_problem

if TYPE_CHECKING:
    from adapters.grpc_tls import ServerTls

__all__ = ["MAX_RECEIVE_BYTES", "SERVER_OPTIONS", "Handlers", "add_port", "instance_label", "peer_address", "peer_host"]

# Envoy lists every version it holds when it reconnects (about 2 MB at 10,000 maps), and one load
# report lists every cluster (1.7 MB): gRPC's 4 MB default is too close.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
# The options of every gRPC server the sidecar runs for Envoys (the xDS server, file mode's LRS).
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
    # Pings find a dead Envoy (or a dead path to it) within about 30 s, on an idle stream too.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default: a second sidecar on the same address would bind it too,
    # and Envoys would split between the two.
    ("grpc.so_reuseport", 0),
]


class Handlers:
    """The tasks a server's stream handlers run in, and what they leave running as they end.
    gRPC's stop returns once its core has shut down, while the handlers it cancelled may still
    be unwinding (a session detaching from the transport): `ended` waits for them, so a stopped
    server has no stream left behind."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[object]] = set()

    def hold(self, task: asyncio.Future[object] | None = None) -> None:
        """Hold `task` (the current one when None) until it is done."""
        task = task if task is not None else asyncio.current_task()
        if task is not None and not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def ended(self, timeout: float) -> None:
        """Wait, at most `timeout` seconds, until every task held is done."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


def add_port(server: grpc.aio.Server, listen: str, flag: str, tls: ServerTls | None = None) -> int:
    """Bind `server` to `listen`, with mutual TLS when `tls` is given; the port. An address that
    cannot be bound raises OSError naming `flag`, and gRPC is not asked to bind it (its own lines
    on stderr would come first)."""
    problem = bind_problem(listen)
    port = 0
    if problem is None:
        try:
            port = server.add_insecure_port(listen) if tls is None else server.add_secure_port(listen, tls.credentials())
        except RuntimeError:  # taken between the check and gRPC's bind; gRPC says only "Failed to bind"
            port = 0
        problem = None if port else "gRPC could not bind it"
    if problem is not None:
        # No errno: the message says more than strerror would (which address, and why).
        raise OSError(None, f"cannot listen on {listen}: {problem}", flag)
    return port


def peer_address(peer: str) -> str:
    """gRPC's peer string (`ipv4:127.0.0.1:42882`, `ipv6:%5B::1%5D:42882`) as host:port."""
    return urllib.parse.unquote(peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer)


def peer_host(peer: str) -> str:
    """The peer's address without its (ephemeral) port."""
    return peer_address(peer).rpartition(":")[0] or peer


def instance_label(node: str, peer: str, others: Iterable[str]) -> str:
    """Pure: an Envoy's instance label among `others`, the peers of the other Envoys connected
    with the same node id: the node id, qualified by the peer's host only when others share the
    node id, and by its port only when they share the host too. A reconnect from a new ephemeral
    port then makes no new label (the xDS server and the load report server name Envoys the same way)."""
    others = list(others)
    if not node:
        return peer_address(peer)
    if not others:
        return node
    host = peer_host(peer)
    if any(peer_host(other) == host for other in others):
        return f"{node}@{peer_address(peer)}"
    return f"{node}@{host}"
