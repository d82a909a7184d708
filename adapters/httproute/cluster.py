"""The gateway's cluster as the HTTPRoute transport talks to it: one connection (its own, from the
kubeconfig, or one it is given), a bound on requests in flight, our objects a page at a time, and
Kubernetes errors translated into adapter errors. All its I/O goes through publisher.kube; it
knows nothing of maps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import aiohttp

from adapters.base import Rejected, Unavailable
from adapters.httproute.options import HttpRouteOptions
from adapters.httproute.owned import ObjectName
from adapters.httproute.render import INSTANCE_LABEL, MANAGED_BY, MANAGED_BY_LABEL
from publisher.kube import HTTP_ROUTES, Kube, KubeError, Resource

# Requests in flight at once: enough to hide the API server's latency at start (10,000 maps), few
# enough to stay well inside API Priority and Fairness' default share for one client.
CONCURRENCY = 32
# List page size. A page is decoded in one call that holds the event loop: kubectl's 500 routes are
# about 0.9 MB of JSON, 20-60 ms on a shared 2-core machine; 100 are a few milliseconds.
PAGE = 100

_R = TypeVar("_R")


@contextlib.asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """The one place Kubernetes errors become adapter errors: refusals of an object are Rejected
    (the caller pins them on its map), everything a retry may fix is Unavailable."""
    try:
        yield
    except KubeError as exc:
        if exc.code in (400, 404, 422):
            raise Rejected(f"{what}: {exc.reason or exc.code}: {exc.message}") from exc
        raise Unavailable(f"{what}: {exc}") from exc


async def all_of(coros: Iterable[Awaitable[_R]]) -> list[_R]:
    """Await them together; once all are done, raise the first failure (Unavailable before
    Rejected, so a retryable failure is never pinned on the map)."""
    outcomes = await asyncio.gather(*coros, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise next((f for f in failures if not isinstance(f, Rejected)), failures[0])
    return outcomes  # type: ignore[return-value]  # no failures: every outcome is an _R


class GatewayCluster:
    """Requests to the gateway's cluster, CONCURRENCY at a time, their errors translated."""

    def __init__(self, options: HttpRouteOptions, kube: Kube | None = None) -> None:
        self._options = options
        self._kube = kube
        self._own_kube = kube is None
        self._limit = asyncio.Semaphore(CONCURRENCY)

    @property
    def selector(self) -> str:
        """Our objects: this publisher's, of this instance."""
        return f"{MANAGED_BY_LABEL}={MANAGED_BY},{INSTANCE_LABEL}={self._options.region}"

    async def connected(self) -> Kube:
        if self._kube is None:
            async with translated("cannot connect to the gateway's cluster"):
                self._kube = await Kube.connect(self._options.gateway_kubeconfig)
        return self._kube

    async def call(self, what: str, call: Callable[[Kube], Awaitable[_R]]) -> _R:
        """One API request, within the concurrency bound, its errors translated."""
        kube = await self.connected()
        async with self._limit, translated(what):
            return await call(kube)

    async def apply(self, resource: Resource, body: dict[str, Any], what: str) -> dict[str, Any]:
        manager = self._options.field_manager
        return await self.call(what, lambda kube: kube.apply(resource, body, field_manager=manager))

    async def pages(self, resource: Resource, selector: str | None) -> AsyncIterator[tuple[list[dict[str, Any]], str]]:
        """Every object of `resource` in our namespace(s) matching `selector`, a page at a time
        (never all of them in memory at once), each with the list's resourceVersion."""
        namespace = self._options.route_namespace
        token: str | None = None
        while True:
            page = await self.call(
                f"cannot list {resource.plural}",
                lambda kube: kube.list(resource, namespace=namespace, label_selector=selector, limit=PAGE, continue_token=token),
            )
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            items, version = page.get("items") or [], str(metadata.get("resourceVersion", ""))
            yield items, version
            if not token:
                return

    async def get_route(self, name: ObjectName) -> dict[str, Any] | None:
        """The route of that name, None when there is none."""
        try:
            return await self.call(f"cannot read route {name[0]}/{name[1]}", lambda kube: kube.get(HTTP_ROUTES, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return None
            raise Unavailable(str(exc)) from exc

    async def delete(self, resource: Resource, name: ObjectName) -> None:
        """Deletes it, if it is there."""
        try:
            await self.call(f"cannot delete {resource.kind} {name[0]}/{name[1]}", lambda kube: kube.delete(resource, *name))
        except Rejected as exc:
            if isinstance(exc.__cause__, KubeError) and exc.__cause__.not_found:
                return
            # A withdrawal has no map to pin a refusal on: retry it with the whole write.
            raise Unavailable(str(exc)) from exc

    @contextlib.asynccontextmanager
    async def watch_routes(self, version: str, timeout: float) -> AsyncIterator[aiohttp.StreamReader]:
        """A watch of our routes from `version`, for about `timeout` seconds."""
        kube = await self.connected()
        async with kube.watch(
            HTTP_ROUTES,
            namespace=self._options.route_namespace,
            resource_version=version,
            label_selector=self.selector,
            timeout_seconds=int(timeout) + 1,
        ) as stream:
            yield stream

    async def aclose(self) -> None:
        if self._own_kube and self._kube is not None:
            await self._kube.close()
            self._kube = None
