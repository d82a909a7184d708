"""Envoy's Load Reporting Service: how many requests each Envoy sent to each map backend.

Served on the sidecar's xDS gRPC server (the bootstrap's `cluster_manager.load_stats_config`
names the xDS cluster). Each Envoy opens one stream; its first request is answered with
`send_all_clusters` and the reporting interval, and every later request is one interval's counts
per cluster and locality. A request counts once it is answered, successfully or not (a backend on
a closed port has requests in error, none "issued"). Counters are latched per stream, so a new
stream starts that Envoy's counting over. Reports are folded on a worker thread: at 10,000 maps
one lists 40,000 clusters (1.7 MB, about 0.1 s of CPU), which on the event loop would hold back
every xDS stream and status write meanwhile; the thread gives the loop the interpreter back every
few milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc
from google.protobuf import duration_pb2

from adapters.base import CountReport
from adapters.envoy import parse_cluster_name
from publisher.model import MapKey

__all__ = ["LoadReports", "fold_clusters"]

# Until counting is enabled, an Envoy is asked for no cluster, this rarely.
_IDLE_INTERVAL = 3600

Counts = dict[MapKey, dict[str, int]]


def fold_clusters(clusters: Iterable[Any], counts: Counts) -> None:
    """Pure: add each map cluster's answered requests (success + error over its localities)."""
    for stats in clusters:
        named = parse_cluster_name(stats.cluster_name)
        if named is None:
            continue
        answered = sum(loc.total_successful_requests + loc.total_error_requests for loc in stats.upstream_locality_stats)
        if answered:
            per_map = counts.setdefault(named[0], {})
            per_map[named[1]] = per_map.get(named[1], 0) + answered


def _fold_report(request: lrs_pb2.LoadStatsRequest) -> tuple[Counts, int, float]:
    """Blocking (run on a worker thread): one report's counts, its bytes and the CPU folding took."""
    began = time.thread_time()
    counts: Counts = {}
    fold_clusters(request.cluster_stats, counts)
    return counts, request.ByteSize(), time.thread_time() - began


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


class LoadReports:
    """The LRS servicer and the xDS gateway's RequestCounter (adapters.base)."""

    def __init__(self) -> None:
        self.interval: float | None = None
        self.reports = 0
        self.fold_seconds = 0.0
        self.report_bytes = 0
        self._pending: list[CountReport] = []
        self._instances: dict[str, int] = {}

    def enable(self, interval: float) -> None:
        self.interval = interval

    async def collect(self) -> list[CountReport]:
        pending, self._pending = self._pending, []
        return pending

    def add_to(self, server: grpc.aio.Server) -> None:
        lrs_pb2_grpc.add_LoadReportingServiceServicer_to_server(_Servicer(self), server)

    def instances(self) -> list[str]:
        return sorted(self._instances)

    def _label(self, node: str, peer: str) -> str:
        # Envoys of one bootstrap share a node id; the peer tells them apart only then.
        label = node or peer
        if label in self._instances:
            label = f"{node}@{peer}"
        self._instances[label] = self._instances.get(label, 0) + 1
        return label

    def _release(self, label: str) -> None:
        left = self._instances.get(label, 0) - 1
        if left > 0:
            self._instances[label] = left
        else:
            self._instances.pop(label, None)

    async def stream(self, requests: AsyncIterator[lrs_pb2.LoadStatsRequest], context: grpc.aio.ServicerContext) -> AsyncIterator[lrs_pb2.LoadStatsResponse]:
        label: str | None = None
        try:
            async for request in requests:
                if label is None:
                    label = self._label(request.node.id, context.peer())
                    if self.interval is None:
                        yield lrs_pb2.LoadStatsResponse(load_reporting_interval=_duration(_IDLE_INTERVAL))
                    else:
                        self._pending.append(CountReport(label, restarted=True))
                        yield lrs_pb2.LoadStatsResponse(send_all_clusters=True, load_reporting_interval=_duration(self.interval))
                    continue
                if self.interval is None:
                    continue
                counts, size, seconds = await asyncio.to_thread(_fold_report, request)
                self.reports += 1
                self.report_bytes += size
                self.fold_seconds += seconds
                self._pending.append(CountReport(label, counts))
        finally:
            if label is not None:
                self._release(label)
                self._pending.append(CountReport(label, left=True))


class _Servicer(lrs_pb2_grpc.LoadReportingServiceServicer):
    def __init__(self, reports: LoadReports) -> None:
        self._reports = reports

    async def StreamLoadStats(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        async for response in self._reports.stream(request_iterator, context):
            yield response
