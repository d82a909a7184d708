"""The Envoy adapter in file mode: the transport that owns two watched files.

The transport owns `DIR/cds.yaml` and `DIR/rds.yaml` (rendered and read back by the pure
adapters.envoy.render), joins the parts into them and replaces them by rename; with
`--envoy-admin` each write is confirmed from Envoy's version readouts (the rejection counters only
when a version is late), and a rejected one restores the last confirmed files; with
`--envoy-lrs-listen` it also serves Envoy's load reports for the served-split check
(adapters.envoy.lrs). Read-back parses off the event loop. Hostname ownership and isolating a
rejected map are the engine's. `build` (adapters.envoy) picks this mode or the xDS server
(adapters.envoy.xds) from `envoy_xds_listen`. It decides nothing about maps and imports no metrics.

Imports adapters.base, publisher.core.values and, in this package, options, render and admin (the admin
API client; adapters.envoy.lrs only when asked for). The bootstraps (adapters.envoy.bootstrap) and
a real Envoy (adapters.envoy.process) are elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from adapters.base import Rejected, TransportDefaults, Unavailable, WriteResult, in_words, write_atomic
from adapters.envoy.admin import EnvoyAdmin, PerSubscription
from adapters.envoy.options import EnvoyOptions
from adapters.envoy.render import (
    CDS_FILE,
    RDS_FILE,
    ClusterText,
    EnvoyPart,
    EnvoyRenderer,
    assemble,
    cds_document,
    read_clusters,
    read_routes,
    route_timeouts,
)
from publisher.core.values import MapKey, Route

if TYPE_CHECKING:
    from adapters.envoy.lrs import LoadReportServer


# The name it had before the move into adapters/envoy/: log filters keep working.
log = logging.getLogger("adapters.envoy")

__all__ = ["EnvoyFileTransport", "EnvoyIO", "build_files"]


# --- I/O: the directory Envoy watches, and its admin API ----------------------------------------------


class EnvoyIO:
    """Files in the watched directory and reads from the admin API (adapters.envoy.admin); unit
    tests replace it."""

    def __init__(self, directory: Path, admin_url: str | None, route_config: str) -> None:
        self._directory = directory
        self._admin = EnvoyAdmin(admin_url, route_config) if admin_url else None

    @property
    def confirms(self) -> bool:
        return self._admin is not None

    async def read(self, filename: str) -> str | None:
        try:
            return await asyncio.to_thread((self._directory / filename).read_text)
        except FileNotFoundError:
            return None

    async def write(self, filename: str, text: str) -> None:
        await asyncio.to_thread(write_atomic, self._directory / filename, text.encode())

    @property
    def admin(self) -> EnvoyAdmin:
        assert self._admin is not None, "no --envoy-admin: nothing to ask"
        return self._admin

    async def versions(self, timeout: float = 5.0) -> PerSubscription:
        return await self.admin.versions(timeout)

    async def rejections(self, timeout: float = 5.0) -> PerSubscription:
        return await self.admin.rejections(timeout)

    async def warming_clusters(self, timeout: float = 5.0) -> int:
        return await self.admin.warming_clusters(timeout)

    async def served_rds(self) -> str:
        return await self.admin.served_rds()

    async def aclose(self) -> None:
        if self._admin is not None:
            await self._admin.aclose()


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """The one place I/O errors of this gateway become AdapterErrors."""
    try:
        yield
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"envoy: {what}: {in_words(exc)}") from exc


class _EnvoyRejected(Exception):
    def __init__(self, what: str, version: str) -> None:
        super().__init__(f"envoy rejected {what} version {version} ({what}.update_rejected rose); Envoy's log has its reason")


# --- The transport ------------------------------------------------------------------------------------


class EnvoyFileTransport(TransportDefaults):
    """The `Transport` of file mode: see the module docstring. The engine drives it, one call at a time."""

    # Each write is a file Envoy reloads (WriteResult.reloads), counted in reloads_total.
    reloads_gateway = True

    # How long Envoy gets to take one file beyond the work it carries: a rename of a small change
    # reloads within milliseconds; past the deadline the write is reported Unavailable and retried.
    confirm_timeout = 10.0
    # Envoy 1.40 spends 0.6-1.2 ms of its main thread per cluster it adds on a 2-core machine (40,000
    # in 25-46 s) and blocks its admin API meanwhile; three times that, per cluster added or removed,
    # lets a first publish of 10,000 maps finish instead of timing out and starting over.
    seconds_per_cluster = 0.003
    # Envoy re-reads the whole rds file on each change; a generous allowance per virtual host in it.
    seconds_per_virtual_host = 0.001
    # A rejected update never shows its version. Once a version is this late, and again each time
    # the wait doubles, one costly counter read tells a rejection from a slow reload.
    rejection_check_after = 0.25

    def __init__(self, options: EnvoyOptions, *, io: EnvoyIO | None = None, load_reports: LoadReportServer | None = None) -> None:
        assert options.envoy_dir is not None, "the file transport needs envoy_dir"
        self._options = options
        self._io = io or EnvoyIO(options.envoy_dir, options.envoy_admin, options.envoy_route_config)
        # File mode's Load Reporting Service (adapters.envoy.lrs.LoadReportServer), when configured:
        # only then is there a request_counter, and the served-split check counts.
        self._load_reports = load_reports
        if load_reports is not None:
            self.request_counter = load_reports.request_counter
        # The files' versions as Envoy holds them ("" when unknown: the next write rewrites that file).
        self._rds_version = ""
        self._cds_version = ""
        # The clusters Envoy holds (old ones leave only after the routes naming them), and the two
        # files Envoy last confirmed: what a rejected write restores. None: unknown.
        self._held_clusters: list[ClusterText] = []
        self._confirmed: tuple[str, str] | None = None
        # Envoy's update_rejected counters as last read (None: not yet): a rise means a rejection.
        self._rejections: PerSubscription | None = None

    async def read(self) -> dict[MapKey, Route]:
        """What Envoy serves: the files when Envoy holds their versions (or is not up yet, and will
        load them), else Envoy's own route configuration. Parsed off the event loop."""
        async with _translated("reading back"):
            rds = await self._io.read(RDS_FILE)
            cds = await self._io.read(CDS_FILE)
            served = await self._served_versions()
            holds_nothing = served is None or (served.rds, served.cds) == ("", "")
            if (rds is None or cds is None) and (self._confirmed is not None or holds_nothing):
                # A missing file: the last confirmed ones go back; with none known and nothing of
                # ours in Envoy, empty ones (it cannot start without both). Else Envoy keeps what it has.
                if self._confirmed is not None:
                    cds, rds = self._confirmed
                else:
                    empty = assemble({}, route_config=self._options.envoy_route_config)
                    cds, rds = empty.cds, empty.rds
                await self._io.write(CDS_FILE, cds)
                await self._io.write(RDS_FILE, rds)
            in_rds = await asyncio.to_thread(self._read_routes, rds) if rds is not None else None
            in_cds = await asyncio.to_thread(read_clusters, cds) if cds is not None else None
            if in_rds and in_cds and (served is None or (served.rds, served.cds) == (in_rds[0], in_cds[0])):
                assert rds is not None and cds is not None
                self._rds_version, self._cds_version = in_rds[0], in_cds[0]
                self._held_clusters, self._confirmed = in_cds[1], (cds, rds)
                routes = in_rds[1]
            else:
                assert served is not None  # without an Envoy answering, both files exist by now
                log.warning(
                    "envoy serves other versions than its files",
                    extra={"served_rds": served.rds, "served_cds": served.cds,
                           "file_rds": in_rds and in_rds[0], "file_cds": in_cds and in_cds[0]},
                )  # fmt: skip
                # What Envoy serves is known only from its own dump: the first write rewrites both
                # files, and a rejection then has nothing confirmed to restore.
                self._rds_version = self._cds_version = ""
                self._held_clusters = in_cds[1] if in_cds and in_cds[0] == served.cds else []
                self._confirmed = None
                if in_rds and in_rds[0] == served.rds:
                    routes = in_rds[1]
                else:
                    _, routes = await asyncio.to_thread(self._read_routes, await self._io.served_rds())
        log.info("envoy state read back", extra={"maps": len(routes), "rds_version": self._rds_version})
        return routes

    def _read_routes(self, rds_text: str) -> tuple[str, dict[MapKey, Route]]:
        """read_routes, with the timeouts this sidecar renders: after they change, every map is
        written again, not only the next one that changes."""
        timeouts = route_timeouts(self._options.route_timeout, self._options.route_idle_timeout)
        return read_routes(rds_text, timeouts=timeouts)

    async def _served_versions(self) -> PerSubscription | None:
        """The versions Envoy holds, or None when there is no admin API or Envoy is not up yet."""
        if not self._io.confirms:
            return None
        try:
            return await self._io.versions()
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up yet: it will load the files.

    async def write(self, parts: Mapping[MapKey, EnvoyPart], changes: Mapping[MapKey, EnvoyPart | None]) -> WriteResult:
        """Make Envoy serve `parts`: new clusters first, then the routes, then old clusters leave.
        Rejected: Envoy refused, and the last confirmed files are back. Unavailable: not confirmed."""
        route_config = self._options.envoy_route_config
        try:
            files = await asyncio.to_thread(assemble, parts, route_config=route_config)
        except ValueError as exc:
            raise Rejected(f"envoy: {exc}") from exc
        if (files.rds_version, files.cds_version) == (self._rds_version, self._cds_version):
            return WriteResult()
        writes = 0
        try:
            async with _translated("writing"):
                if files.cds_version != self._cds_version:
                    names = {name for name, _, _ in files.clusters}
                    leftovers = [c for c in self._held_clusters if c[0] not in names]
                    held_names = {name for name, _, _ in self._held_clusters}
                    added = [text for name, text, _ in files.clusters if name not in held_names]
                    first_version, first_text = (
                        cds_document(files.clusters + leftovers) if files.rds_version != self._rds_version and leftovers
                        else (files.cds_version, files.cds)
                    )  # fmt: skip
                    writes += 1
                    await self._write(
                        CDS_FILE, first_text, first_version, "cds",
                        allowance=self.seconds_per_cluster * len(added),
                        # Only a cluster that resolves a name warms for long; an IP one is active at once.
                        warming=any('"type":"LOGICAL_DNS"' in text for text in added),
                    )  # fmt: skip
                    self._cds_version = first_version
                    self._held_clusters = files.clusters + (leftovers if first_version != files.cds_version else [])
                if files.rds_version != self._rds_version:
                    writes += 1
                    await self._write(
                        RDS_FILE, files.rds, files.rds_version, "rds", allowance=self.seconds_per_virtual_host * len(parts)
                    )
                    self._rds_version = files.rds_version
                if files.cds_version != self._cds_version:
                    writes += 1
                    leftover_count = len(self._held_clusters) - len(files.clusters)
                    await self._write(
                        CDS_FILE, files.cds, files.cds_version, "cds", allowance=self.seconds_per_cluster * leftover_count
                    )
                    self._cds_version = files.cds_version
                    self._held_clusters = files.clusters
        except _EnvoyRejected as exc:
            log.warning("envoy rejected an update", extra={"maps": len(changes), "error": str(exc)})
            await self._restore()
            raise Rejected(str(exc)) from exc
        self._confirmed = (files.cds, files.rds)
        log.debug("envoy updated", extra={"rds_version": files.rds_version, "cds_version": files.cds_version, "writes": writes})
        return WriteResult(reloads=writes)

    async def _write(
        self, filename: str, text: str, version: str, what: str, *, allowance: float = 0.0, warming: bool = False
    ) -> None:
        """Write one file; with an admin URL, wait until Envoy took exactly this version."""
        if self._io.confirms and self._rejections is None:
            self._rejections = await self._read_rejections()
        await self._io.write(filename, text)
        if self._io.confirms:
            await self._confirm(what, version, self.confirm_timeout + allowance, warming=warming)

    async def _confirm(self, what: str, version: str, timeout: float, *, warming: bool) -> None:
        """Poll the cheap version readouts until `version` shows; read the costly rejection counters
        only while it is late. Raises _EnvoyRejected, or TimeoutError past `timeout`."""
        start = time.monotonic()
        deadline = start + timeout
        check_at = start + self.rejection_check_after
        delay = 0.001
        while (await self._io.versions(max(deadline - time.monotonic(), 1.0))).of(what) != version:
            now = time.monotonic()
            if now >= check_at or now >= deadline:
                await self._check_rejected(what, version, max(deadline - now, 1.0))
                if now >= deadline:
                    raise asyncio.TimeoutError(f"{what} version {version} not confirmed in {timeout:.1f}s")
                check_at = now + (now - start)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        while warming and await self._io.warming_clusters(max(deadline - time.monotonic(), 1.0)) > 0:
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError(f"{what} version {version}: clusters still warming after {timeout:.1f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _read_rejections(self) -> PerSubscription | None:
        try:
            return await self._io.rejections(self.confirm_timeout)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up: the first late version reads them instead.

    async def _check_rejected(self, what: str, version: str, timeout: float) -> None:
        before, self._rejections = self._rejections, await self._io.rejections(timeout)
        if before is not None and self._rejections.of(what) > before.of(what):
            raise _EnvoyRejected(what, version)

    async def _restore(self) -> None:
        """Put the last confirmed files back and wait until Envoy holds them again. Unavailable
        when there are none, or Envoy does not take them back."""
        if self._confirmed is None:
            self._rds_version = self._cds_version = ""
            raise Unavailable("envoy rejected an update, and no confirmed files are known to restore")
        cds, rds = self._confirmed
        cds_version, clusters = await asyncio.to_thread(read_clusters, cds)
        rds_version, routes = await asyncio.to_thread(read_routes, rds)
        self._rds_version = self._cds_version = ""
        try:
            async with _translated("restoring"):
                await self._write(CDS_FILE, cds, cds_version, "cds", allowance=self.seconds_per_cluster * len(clusters))
                await self._write(RDS_FILE, rds, rds_version, "rds", allowance=self.seconds_per_virtual_host * len(routes))
        except _EnvoyRejected as exc:
            raise Unavailable(f"envoy: restoring the last confirmed files: {exc}") from exc
        self._rds_version, self._cds_version, self._held_clusters = rds_version, cds_version, clusters

    async def serve(self) -> None:
        """The Load Reporting Service's server until cancelled, when configured."""
        if self._load_reports is not None:
            await self._load_reports.serve()

    async def aclose(self) -> None:
        await self._io.aclose()


def build_files(options: EnvoyOptions) -> tuple[EnvoyRenderer, EnvoyFileTransport]:
    """File mode's renderer and transport for the engine."""
    renderer = EnvoyRenderer(
        rewrite_host=options.rewrite_host,
        ca_file=options.envoy_ca_file,
        timeout=options.route_timeout,
        idle_timeout=options.route_idle_timeout,
    )
    return renderer, EnvoyFileTransport(options, load_reports=_load_report_server(options))


def _load_report_server(options: EnvoyOptions) -> LoadReportServer | None:
    """File mode's LRS server on --envoy-lrs-listen, or None: not asked for, or no grpcio."""
    if options.envoy_lrs_listen is None:
        return None
    try:
        from adapters.envoy.lrs import LoadReportServer
    except ImportError as exc:
        log.warning("envoy file mode counts no requests: the load report server needs grpcio", extra={"error": str(exc)})
        return None
    return LoadReportServer(options.envoy_lrs_listen, options.load_server_tls())
