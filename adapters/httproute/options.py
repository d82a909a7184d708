"""The Gateway API gateway's options: where the routes go and how they point at the workload clusters."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.timeouts import RouteTimeout, route_timeout_field
from publisher.core.addresses import is_dns_label, is_dns_subdomain
from publisher.core.durations import Duration
from publisher.core.values import MapKey

# `<map>-global` names OME's own route for an InferenceService: an instance of this name would
# write routes named like OME's. The chart refuses it too (tools/chart_limits.py).
RESERVED_INSTANCE = "global"


class HttpRouteOptions(BaseModel):
    """Where the routes go and how they point at the workload clusters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gateway_kubeconfig: Path | None = Field(
        default=None,
        description="Kubeconfig of the gateway's cluster; none means in-cluster, as the sidecar runs beside the gateway.",
    )
    gateway: str = Field(description="The parent Gateway, NAMESPACE/NAME; required, as there is no default Gateway.")
    backend_port: int = Field(
        ge=1, le=65535, description="Port of every ExternalName Service; required, as only the install knows it."
    )
    route_namespace: str | None = Field(
        default=None,
        description="Namespace of the routes and Services; none keeps each beside its map, as OME's own publisher does.",
    )
    region: str = Field(default="default", description="This region (--region); 'default' as the CLI's default.")
    route_status_timeout: Duration = Field(
        default=5.0,
        description="How long to wait for the gateway to report on a route; covers a healthy controller's reconcile.",
    )
    route_timeout: RouteTimeout = route_timeout_field()

    @field_validator("gateway")
    @classmethod
    def _namespaced_name(cls, value: str) -> str:
        namespace, _, name = value.partition("/")
        if not is_dns_label(namespace) or not is_dns_subdomain(name):
            raise ValueError(f"{value!r} is not NAMESPACE/NAME")
        return value

    @field_validator("route_namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not is_dns_label(value):
            raise ValueError(f"{value!r} is not a DNS label")
        return value

    @field_validator("region")
    @classmethod
    def _instance(cls, value: str) -> str:
        if not is_dns_label(value):
            raise ValueError(f"{value!r} is not a DNS label")
        if value == RESERVED_INSTANCE:
            # `<map>-global` is the name of OME's own route for the same InferenceService.
            raise ValueError("'global' would name our routes like OME's own '<isvc>-global'")
        return value

    @property
    def gateway_namespace(self) -> str:
        return self.gateway.partition("/")[0]

    @property
    def gateway_name(self) -> str:
        return self.gateway.partition("/")[2]

    @property
    def field_manager(self) -> str:
        return f"ome-gateway-publisher-{self.region}"

    def namespace_for(self, key: MapKey) -> str:
        return self.route_namespace or key.namespace

