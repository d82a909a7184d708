"""`KubeSource`: TrafficMaps and InferenceServices from an API server, one Informer per resource and
namespace, and when the source as a whole is synced, stale or refused."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from publisher.core.model import parse_status_change, parse_traffic_map
from publisher.core.values import condition_type
from publisher.kube import INFERENCE_SERVICES, TRAFFIC_MAPS, Kube
from publisher.source.informer import Informer, WatchOptions
from publisher.source.objects import map_digest, parse_isvc
from publisher.source.refusals import SourceRefused
from publisher.source.store import ChangeSink, MappedOnly, Stores

log = logging.getLogger("publisher.source")  # the logger name these logs have always printed


class KubeSource:
    """TrafficMaps and InferenceServices from an API server, per namespace or cluster-wide."""

    def __init__(self, kube: Kube, stores: Stores, sink: ChangeSink, options: WatchOptions, *, clock: Callable[[], float]) -> None:
        self._kube = kube
        self._stores = stores
        self._sink = sink
        self._options = options
        self._clock = clock
        self._pending_sync = 0
        self._informers: list[Informer[Any]] = []
        self._stale = False

    def _make_informers(self) -> list[Informer[Any]]:
        namespaces: tuple[str | None, ...] = self._options.namespaces or (None,)
        informers: list[Informer[Any]] = []
        isvc_sink = MappedOnly(self._sink, self._stores.maps)
        region = self._options.region
        digest = functools.partial(map_digest, own_condition=condition_type(region)) if region is not None else None
        for namespace in namespaces:
            for resource, store, parse, sink, digested, restatus in (
                (TRAFFIC_MAPS, self._stores.maps, parse_traffic_map, self._sink, digest, parse_status_change),
                (INFERENCE_SERVICES, self._stores.isvcs, parse_isvc, isvc_sink, None, None),
            ):
                informers.append(
                    Informer(
                        self._kube,
                        resource,
                        namespace=namespace,
                        options=self._options,
                        store=store,
                        parse=parse,
                        sink=sink,
                        on_synced=self._one_synced,
                        clock=self._clock,
                        digest=digested,
                        restatus=restatus,
                    )
                )
        return informers

    async def run(self) -> None:
        self._informers = self._make_informers()
        self._pending_sync = len(self._informers)
        started = self._clock()
        try:
            async with asyncio.TaskGroup() as group:
                for informer in self._informers:
                    group.create_task(informer.run())
                group.create_task(self._watch_staleness(started))
        except ExceptionGroup as group:
            # A refusal under --once ends every informer; the caller wants the reason, not a group.
            refused = next((e for e in group.exceptions if isinstance(e, SourceRefused)), None)
            if refused is not None:
                raise refused from None
            raise

    def problem(self) -> str | None:
        """What is wrong with the source now (None: nothing known)."""
        return next((i.health.problem for i in self._informers if i.health.problem is not None), None)

    def age(self, since: float) -> float:
        """Seconds since the least recent success of any informer (counted from `since` for one
        that never succeeded)."""
        now = self._clock()
        return max((now - (i.health.last_success if i.health.last_success is not None else since) for i in self._informers), default=0.0)

    async def _watch_staleness(self, started: float) -> None:
        """Log once when the source goes stale and once when it is fresh again: the gateway keeps
        serving either way, so this is news for the operator, not a reason to change anything."""
        interval = min(5.0, self._options.stale_after / 4)
        while True:
            await asyncio.sleep(interval)
            age = self.age(started)
            if age > self._options.stale_after and not self._stale:
                self._stale = True
                log.warning("source stale, gateway keeps serving", extra={"age_seconds": round(age), "problem": self.problem()})
            elif age <= self._options.stale_after and self._stale:
                self._stale = False
                log.info("source fresh again")

    def _one_synced(self) -> None:
        self._pending_sync -= 1
        if self._pending_sync == 0:
            self._sink.synced()
