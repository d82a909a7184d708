"""The Gateway API gateway: per map, an HTTPRoute `<map>-<instance>` and an ExternalName Service
per backend. Its options and `build`, for the registry (adapters.ADAPTERS).

- options.py: HttpRouteOptions.
- render.py: pure; names, validation, the objects as applied, and reading a route back.
- owned.py: pure; the transport's ownership bookkeeping: which objects are ours, by map (and
  how each map's are judged), which route names are claimed, what a write applies or deletes.
- cluster.py: the gateway's cluster as the transport talks to it, through publisher.kube: the
  connection, requests in flight, pages, errors as adapter errors.
- transport.py: HttpRouteTransport, server-side apply, verdicts from route status, garbage
  collection and read-back.
"""

from __future__ import annotations

from adapters.httproute.options import RESERVED_INSTANCE, HttpRouteOptions
from adapters.httproute.render import (
    UNKNOWN_ROUTE,
    BackendRef,
    HttpRouteRenderer,
    ObjectGroup,
    parse_route,
    render_route,
    render_service,
    route_name,
    route_verdict,
    service_name,
)
from adapters.httproute.transport import ALL_ZERO_NOTE, NOT_REPORTED_NOTE, HttpRouteTransport

__all__ = [
    "ALL_ZERO_NOTE",
    "NOT_REPORTED_NOTE",
    "RESERVED_INSTANCE",
    "BackendRef",
    "HttpRouteOptions",
    "HttpRouteRenderer",
    "HttpRouteTransport",
    "ObjectGroup",
    "UNKNOWN_ROUTE",
    "build",
    "parse_route",
    "render_route",
    "render_service",
    "route_name",
    "route_verdict",
    "service_name",
]


def build(options: HttpRouteOptions) -> tuple[HttpRouteRenderer, HttpRouteTransport]:
    """The gateway as the engine drives it."""
    return HttpRouteRenderer(options), HttpRouteTransport(options)
