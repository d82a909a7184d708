"""The Gateway API gateway: per map, an HTTPRoute `<map>-<instance>` and an ExternalName Service
per backend. Its options and `build`, for the registry (adapters.ADAPTERS).

- options.py: HttpRouteOptions.
- render.py: pure; names, validation, the objects as applied, and reading a route back.
- owned.py: pure; what the transport knows of one map's objects and how it judges them.
- transport.py: HttpRouteTransport, server-side apply, verdicts from route status, garbage
  collection and read-back, all through publisher.kube.
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
