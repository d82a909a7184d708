"""Envoy's Load Reporting Service: how many requests each Envoy sent to each map backend.

In xDS mode it is served on the sidecar's xDS gRPC server (the bootstrap's
`cluster_manager.load_stats_config` names the xDS cluster); in file mode on a gRPC server of its
own (`LoadReportServer`, `--envoy-lrs-listen`, the bootstrap's `--lrs`). Each Envoy opens one stream; its first request is answered, once
the split check has started, with `send_all_clusters` and the reporting interval, and every later request is one interval's counts
per cluster and locality. A request counts when it is issued to the cluster's upstream
(`total_issued_requests`: Envoy counts it as its stream is given an upstream connection, right
after the pick), never when it ends: a stream picked before a drain and answered minutes later is
counted before it. Left out: requests that never got an upstream connection (a backend on a closed
port has requests in error, none issued); a retry is issued, and counted, again. Counters are
latched per stream, so a new stream starts that Envoy's counting over. However fast an Envoy
reports, each stream keeps at most one report waiting to be collected: the next is added to it.
Reports are folded on a worker thread: at 10,000 maps one lists 40,000 backends (as 40,000
clusters, 1.7 MB and about 0.1 s of CPU), which on the event loop would hold back every xDS
stream and status write meanwhile; the thread gives the loop the interpreter back every few milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.protobuf import duration_pb2

from adapters.base import RequestCounts
from adapters.envoy.names import parse_cluster_name, parse_map_cluster_name
from adapters.grpc_server import SERVER_OPTIONS, Handlers, add_port, instance_label, peer_address
from adapters.grpc_tls import ServerTls
from publisher.core.values import MapKey

__all__ = ["LoadReportServer", "LoadReports", "fold_clusters"]

# The name it had before the move into adapters/envoy/: log filters keep working.
log = logging.getLogger("adapters.envoy_lrs")

Counts = dict[MapKey, dict[str, int]]


def fold_clusters(clusters: Iterable[Any], counts: Counts) -> None:
    """Pure: add each backend's issued requests. File mode's cluster per backend counts over its
    localities; xDS mode's cluster per map counts per locality, each named after its backend."""
    for stats in clusters:
        named = parse_cluster_name(stats.cluster_name)
        if named is not None:
            _add(counts, named[0], named[1], sum(loc.total_issued_requests for loc in stats.upstream_locality_stats))
            continue
        key = parse_map_cluster_name(stats.cluster_name)
        if key is not None:
            for loc in stats.upstream_locality_stats:
                _add(counts, key, loc.locality.sub_zone, loc.total_issued_requests)


def _add(counts: Counts, key: MapKey, backend: str, issued: int) -> None:
    if issued:
        per_map = counts.setdefault(key, {})
        per_map[backend] = per_map.get(backend, 0) + issued


def add_counts(into: Counts, counts: Counts) -> None:
    """Pure: add `counts` into `into`."""
    for key, per in counts.items():
        mine = into.setdefault(key, {})
        for cluster, n in per.items():
            mine[cluster] = mine.get(cluster, 0) + n


def _fold_report(request: lrs_pb2.LoadStatsRequest) -> tuple[Counts, int, float]:
    """Blocking (run on a worker thread): one report's counts, its bytes and the CPU folding took."""
    began = time.thread_time()
    counts: Counts = {}
    fold_clusters(request.cluster_stats, counts)
    return counts, request.ByteSize(), time.thread_time() - began


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


@dataclass
class _Waiting:
    """A report waiting to be collected: a stream's start, its counts since the last collect, or its end."""

    label: str
    counts: Counts = field(default_factory=dict)
    restarted: bool = False
    left: bool = False
    at: float | None = None

    def report(self) -> RequestCounts:
        return RequestCounts(self.label, self.counts, restarted=self.restarted, left=self.left, at=self.at)


class LoadReports:
    """The LRS servicer and the xDS gateway's RequestCounter (adapters.base); its streams' tasks
    are held in `handlers`, which the server's stop waits for."""

    def __init__(self, handlers: Handlers | None = None) -> None:
        self.handlers = handlers if handlers is not None else Handlers()
        self.interval: float | None = None
        self._enabled = asyncio.Event()
        self.reports = 0
        self.fold_seconds = 0.0
        self.report_bytes = 0
        # Reports not yet collected, in order; per stream at most a start, one report (the
        # intervals since the last collect, summed into `_summing`) and an end.
        self._pending: list[_Waiting] = []
        self._summing: dict[object, _Waiting] = {}
        # Each open stream's label -> (node id, peer).
        self._streams: dict[str, tuple[str, str]] = {}
        self.clock: Callable[[], float] = time.monotonic

    def enable(self, interval: float) -> None:
        self.interval = interval
        self._enabled.set()

    async def collect(self) -> list[RequestCounts]:
        pending, self._pending = self._pending, []
        self._summing.clear()
        return [waiting.report() for waiting in pending]

    def _counted(self, stream: object, label: str, counts: Counts, at: float) -> None:
        """One interval's counts of a stream: added to its report waiting to be collected, whose
        interval then ends with this one."""
        summing = self._summing.get(stream)
        if summing is None:
            self._summing[stream] = summing = _Waiting(label)
            self._pending.append(summing)
        add_counts(summing.counts, counts)
        summing.at = at

    def add_to(self, server: grpc.aio.Server) -> None:
        lrs_pb2_grpc.add_LoadReportingServiceServicer_to_server(_Servicer(self), server)

    def instances(self) -> list[str]:
        return sorted(self._streams)

    def _label(self, node: str, peer: str) -> str:
        label = instance_label(node, peer, (p for n, p in self._streams.values() if n == node))
        if label in self._streams:
            # The same Envoy's new stream before its old one ended: told apart by its port.
            label = f"{node}@{peer_address(peer)}"
        self._streams[label] = (node, peer)
        return label

    def _release(self, label: str) -> None:
        self._streams.pop(label, None)

    async def stream(self, requests: AsyncIterator[lrs_pb2.LoadStatsRequest], context: grpc.aio.ServicerContext) -> AsyncIterator[lrs_pb2.LoadStatsResponse]:
        self.handlers.hold()
        label: str | None = None
        stream = object()  # this stream's identity: a reconnect may reuse its label
        try:
            async for request in requests:
                if label is None:
                    label = self._label(request.node.id, context.peer())
                    # An Envoy that connects before the split check starts waits for its answer
                    # (Envoy reports only once answered), so it reports at the check's interval
                    # from its first one.
                    await self._enabled.wait()
                    assert self.interval is not None
                    # Envoy counts from this answer on.
                    self._pending.append(_Waiting(label, restarted=True, at=self.clock()))
                    yield lrs_pb2.LoadStatsResponse(send_all_clusters=True, load_reporting_interval=_duration(self.interval))
                    continue
                at = self.clock()
                counts, size, seconds = await asyncio.to_thread(_fold_report, request)
                self.reports += 1
                self.report_bytes += size
                self.fold_seconds += seconds
                self._counted(stream, label, counts, at)
        finally:
            if label is not None:
                self._release(label)
                self._summing.pop(stream, None)
                self._pending.append(_Waiting(label, left=True, at=self.clock()))


class LoadReportServer:
    """File mode's gRPC server: only the Load Reporting Service, on `listen` (`--envoy-lrs-listen`).
    Its `request_counter` is the file transport's RequestCounter."""

    def __init__(self, listen: str, tls: ServerTls | None = None) -> None:
        self.listen = listen
        self._tls = tls
        self.request_counter = LoadReports()
        self.port: int | None = None
        self._serving = asyncio.Event()

    async def serve(self) -> None:
        """Listen and serve Envoys' load reports until cancelled. An address another process holds
        raises OSError naming --envoy-lrs-listen."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        self.request_counter.add_to(server)
        self.port = add_port(server, self.listen, "--envoy-lrs-listen", self._tls)
        await server.start()
        self._serving.set()
        log.info("load report server listening", extra={"listen": self.listen, "port": self.port})
        try:
            await asyncio.Event().wait()
        finally:
            # Shielded: a cancelled serve() must still stop the server, free its port and see
            # its streams end.
            await asyncio.shield(self._stop(server))

    async def _stop(self, server: grpc.aio.Server) -> None:
        await server.stop(0)
        await self.request_counter.handlers.ended(1.0)

    async def started(self) -> int:
        """Wait until `serve()` listens; the bound port (for a listen address with port 0)."""
        await self._serving.wait()
        assert self.port is not None
        return self.port


class _Servicer(lrs_pb2_grpc.LoadReportingServiceServicer):
    def __init__(self, reports: LoadReports) -> None:
        self._reports = reports

    async def StreamLoadStats(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        async for response in self._reports.stream(request_iterator, context):
            yield response
