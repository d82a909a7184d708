"""Assembles a running publisher from a RunConfig: the adapter, the source, the loop.

The only module that turns configuration into objects; cli.py calls it and prints what it returns.
`verify_cluster` assembles the same loop as `run --dry-run` does, so the verify command's verdict
is the sidecar's own decision, not a second implementation of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters import ADAPTERS
from adapters.base import Adapter, ApplyResult, Reconciled, RequestCounter, TransportDefaults, WriteResult, publication_problem
from adapters.engine import Engine
from publisher.core import gate
from publisher import loop, metrics, status
from publisher.status import region_report
from publisher.cli.config import ConfigError, RunConfig, adapter_options
from publisher.kube import Kube
from publisher.loop import LeaderOptions, LoopOptions, Publisher
from publisher.core.model import InvalidObject, TrafficMap
from publisher.core.values import Held, MapKey, Publication, Reason, Route
from publisher.status.region_report import RegionReportSink
from publisher.split.check import SplitVerifier
from publisher.source.directory import DirectorySource
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Stores

log = logging.getLogger("publisher.app")


def build_adapter(config: RunConfig) -> Adapter:
    """The chosen gateway's engine with its options taken from the config; errors name the flags."""
    return ADAPTERS[config.adapter].engine(config.adapter, adapter_options(config))


class Checker(Protocol):
    """What a dry run uses of the engine it wraps."""

    name: str

    def check(self, pub: Publication) -> Held | None: ...

    async def aclose(self) -> None: ...


class PlannedGateway(TransportDefaults):
    """An empty gateway that takes every write and keeps nothing: what a plan is made against."""

    def problem(self, key: MapKey, route: Route) -> str | None:
        return None

    def render(self, key: MapKey, route: Route) -> Route:
        return route

    async def read(self) -> dict[MapKey, Route]:
        return {}

    async def write(self, parts: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]) -> WriteResult:
        return WriteResult()


class DryRunAdapter(TransportDefaults):
    """Wraps an engine so nothing is written: records what would have been applied. The plan is
    made by the sidecar's own Engine over an empty PlannedGateway, so hostnames go as the sidecar
    gives them (one map each, the older TrafficMap first; the others held HostConflict)."""

    def __init__(self, inner: Checker) -> None:
        self._inner = inner
        self.name = inner.name
        self.desired: dict[MapKey, Publication] = {}
        gateway = PlannedGateway()
        self._plan = Engine(inner.name, gateway, gateway)

    @property
    def confirmed(self) -> Mapping[MapKey, Route]:
        return self._plan.confirmed

    def check(self, pub: Publication) -> Held | None:
        return self._inner.check(pub)

    async def start(self) -> Mapping[MapKey, Route]:
        return {}

    async def apply(self, changes: Mapping[MapKey, Publication | None]) -> ApplyResult:
        planned = await self._plan.apply(changes)
        for key, pub in changes.items():
            if pub is None:
                self.desired.pop(key, None)
            elif key not in planned.rejected:
                self.desired[key] = pub
        return ApplyResult(rejected=planned.rejected, released=planned.released, wrote=False)

    async def reconcile(self) -> Reconciled:
        return Reconciled()

    @property
    def reads_in_pages(self) -> bool:
        return False

    async def reconcile_page(self, keys: Collection[MapKey], *, last: bool) -> Reconciled:
        return Reconciled()

    async def aclose(self) -> None:
        await self._inner.aclose()


class CommonChecks:
    """The strict checks every adapter applies, without a gateway: what `verify` holds a map for
    when it is not told which adapter the sidecar runs."""

    name = "verify"

    def check(self, pub: Publication) -> Held | None:
        problem = publication_problem(pub)
        return Held(Reason.INVALID_PLAN, problem) if problem is not None else None

    async def aclose(self) -> None:
        return None


@dataclass
class Summary:
    """What one pass did, for --once and --dry-run output and exit codes."""

    publications: list[Publication] = field(default_factory=list)
    held: list[dict[str, Any]] = field(default_factory=list)

    @property
    def all_published(self) -> bool:
        return not self.held


def _identity(config: RunConfig) -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


async def run_until_signalled(config: RunConfig) -> Summary | None:
    """`run`, ended cleanly (adapter and API connections closed) by SIGTERM or SIGINT, as a
    container runtime stops a pod."""
    task = asyncio.current_task()
    assert task is not None
    event_loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        event_loop.add_signal_handler(signum, task.cancel)
    try:
        return await run(config)
    except asyncio.CancelledError:
        log.info("stopped by signal")
        return None
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            event_loop.remove_signal_handler(signum)


async def run(config: RunConfig) -> Summary | None:
    """Run as configured. Returns a Summary for --once and --dry-run; runs forever otherwise."""
    if config.name is not None:
        log.warning("--name is deprecated (one release): use --region", extra={"region": config.region})
    adapter: Adapter = build_adapter(config)
    if config.dry_run:
        adapter = DryRunAdapter(adapter)
    transport = getattr(adapter, "transport", None)
    metrics.start(
        config.adapter,
        source="kube" if config.source == "kube" else "dir",
        reloads=getattr(transport, "reloads_gateway", False),
        status=config.effective_status_mode != "off" and not config.dry_run,
    )
    metrics.per_map(config.metrics_per_map)
    metrics.watch_envoys(transport if isinstance(transport, metrics.EnvoyFleet) else None)
    stats = getattr(transport, "stats", None)
    metrics.watch_nginx_table(stats if isinstance(stats, metrics.NginxTableStats) else None)
    kube = await Kube.connect(config.kubeconfig) if config.source == "kube" else None
    try:
        publisher, source = _assemble(config, adapter, kube)
        counter = getattr(transport, "request_counter", None)
        if config.split_verify == "on" and isinstance(counter, RequestCounter) and not (config.once or config.dry_run):
            publisher.split = SplitVerifier(counter, config.split_interval, config.adapter, publisher.split_changed)
        metrics.watch_split(publisher.split)
        if config.once or config.dry_run:
            await loop.once(publisher, source, read_gateway=not config.dry_run, timeout=config.timeout)
            return _summary(publisher, adapter)
        leader = LeaderOptions(config.effective_lease_namespace(), _identity(config)) if config.leader_elect else None
        await loop.run(publisher, source, listen=config.listen_address, leader=leader, kube=kube)
        return None
    finally:
        await asyncio.shield(_close(adapter, kube))


@dataclass(frozen=True)
class Verdict:
    """What the sidecar would decide for one map: `published`, `held` or `withdrawn`."""

    item: TrafficMap | InvalidObject
    state: str
    reason: str | None
    message: str | None


async def verify_cluster(config: RunConfig, names: frozenset[str] = frozenset(), timeout: float = 30.0) -> list[Verdict]:
    """One dry pass of the sidecar's own loop over the maps and InferenceServices on the API server
    (`config.kubeconfig`, `config.namespace`), with the checks every adapter makes. Returns a Verdict
    per map, in key order, only for maps named in `names` when it is not empty."""
    adapter = DryRunAdapter(CommonChecks())
    kube = await Kube.connect(config.kubeconfig)
    try:
        publisher, source = _assemble(config.model_copy(update={"dry_run": True, "source": "kube"}), adapter, kube)
        try:
            await asyncio.wait_for(loop.once(publisher, source, read_gateway=False), timeout)
        except TimeoutError:
            raise ConfigError(f"--kubeconfig: no full list of TrafficMaps and InferenceServices within {timeout:g}s") from None
        verdicts = []
        for key in sorted(publisher.states):
            item = publisher.stores.maps.get(key)
            if item is None or (names and key.name not in names):
                continue
            state = publisher.states[key]
            verdicts.append(Verdict(item, state.state, state.reason, state.message))
        return verdicts
    finally:
        await asyncio.shield(_close(adapter, kube))


def _assemble(config: RunConfig, adapter: Adapter, kube: Kube | None) -> tuple[Publisher, loop.Source]:
    """The loop and the source of `run`, wired as `config` says."""
    options = LoopOptions(
        region=config.region,
        adapter_name=config.adapter,
        gate=gate.GateOptions(published_gate=config.ome_published_gate),
        host_template=config.host_template,
        resync=config.resync,
        status_delay=config.status_delay,
        probe_max_age=config.probe_max_age,
        ready_without_gateway=config.ready_without_gateway,
    )
    stores = Stores.empty()
    mode = "off" if config.dry_run or kube is None else config.effective_status_mode
    sink = status_sink(mode, kube, stores, config.region, config.namespace) if kube is not None else None
    publisher = Publisher(stores, adapter, options, status_sink=sink)
    source: loop.Source
    source_dir = config.source_dir
    if source_dir is not None:
        if not source_dir.is_dir():
            raise ConfigError(f"--source: {source_dir} is not a directory")
        source = DirectorySource(source_dir, stores, publisher, clock=publisher.clock)
    else:
        assert kube is not None
        one_pass = config.once or config.dry_run
        watch = WatchOptions(namespaces=config.namespace, label_selector=config.label_selector,
                             refusals_fatal=one_pass, stale_after=config.source_stale_after, region=config.region)
        source = KubeSource(kube, stores, publisher, watch, clock=publisher.clock)
    return publisher, source


def status_sink(mode: str, kube: Kube, stores: Stores, region: str, namespaces: tuple[str, ...]) -> status.StatusSink | None:
    """Where `region`'s verdicts go in `mode` (None: off). Each mode's sink removes what the
    region left in the other mode, so `status` reads the region's current mode alone."""
    if mode == "condition":
        return status.ConditionSink(kube, stores.maps, region, drop_leftovers=lambda: region_report.drop_leftovers(kube, region, namespaces))
    if mode == "report":
        return RegionReportSink(kube, region, known=lambda key: stores.maps.get(key) is not None, namespaces=namespaces,
                                has_condition=lambda key: status.own_condition(stores.maps.get(key), region) is not None)
    return None


async def _close(adapter: Adapter, kube: Kube | None) -> None:
    await adapter.aclose()
    if kube is not None:
        await kube.close()


def _summary(publisher: Publisher, adapter: Adapter) -> Summary:
    published = adapter.desired if isinstance(adapter, DryRunAdapter) else publisher.provenance
    served = publisher.published
    summary = Summary(publications=[published[k] for k in sorted(published) if k in served])
    for key, state in sorted(publisher.states.items()):
        if state.state in ("held", "failed"):
            summary.held.append({"namespace": key.namespace, "name": key.name, "reason": state.reason, "message": state.message})
    return summary
