"""The Envoy adapter's options, both modes' (files: adapters.envoy.files; xDS: adapters.envoy.xds)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.timeouts import RouteIdleTimeout, RouteTimeout, route_idle_timeout_field, route_timeout_field

__all__ = ["ROUTE_CONFIG_PATTERN", "EnvoyOptions"]

# A route configuration's name (the chart's values schema states it too: tools/chart_limits.py).
ROUTE_CONFIG_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$"


def _admin_url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError(f"{value!r} is not a URL: give the scheme, e.g. http://127.0.0.1:9901")
    return value


_AdminUrl = Annotated[str, AfterValidator(_admin_url)]


class EnvoyOptions(BaseModel):
    """How the sidecar reaches its Envoys: as their xDS server, or through a watched directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    envoy_xds_listen: str | None = Field(
        default=None,
        description="HOST:PORT of the delta ADS server Envoys connect to (the bootstrap's --xds); exactly one of it and envoy_dir.",
    )
    envoy_dir: Path | None = Field(default=None, description="Directory Envoy watches; it must match Envoy's bootstrap.")
    envoy_lrs_listen: str | None = Field(
        default=None,
        description="file mode: HOST:PORT of a gRPC server with only Envoy's Load Reporting Service, for the served-split "
        "check (the bootstrap's --lrs); needs grpcio. xDS mode serves it on --envoy-xds-listen.",
    )
    envoy_route_config: str = Field(
        default="ome-global",
        pattern=ROUTE_CONFIG_PATTERN,
        description="Route configuration name; 'ome-global' echoes OME's own '<isvc>-global' without colliding.",
    )
    envoy_admin: _AdminUrl | None = Field(
        default=None,
        description="Admin URL to confirm each write; off by default, as the admin port is often not exposed.",
    )
    envoy_ca_file: Path = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="CA bundle for https endpoints; Debian's and Alpine's system trust store, as Envoy has none.",
    )
    rewrite_host: bool = Field(
        default=False,
        description="Send each backend its endpoint's host; off, as OME's own publisher passes the Host through.",
    )
    route_timeout: RouteTimeout = route_timeout_field()
    route_idle_timeout: RouteIdleTimeout = route_idle_timeout_field()

    @field_validator("envoy_xds_listen", "envoy_lrs_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{value!r} is not HOST:PORT")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> EnvoyOptions:
        if (self.envoy_xds_listen is None) == (self.envoy_dir is None):
            raise ValueError("give exactly one of --envoy-xds-listen (xDS server) and --envoy-dir (watched files)")
        if self.envoy_lrs_listen is not None and self.envoy_xds_listen is not None:
            raise ValueError("--envoy-lrs-listen is for file mode (--envoy-dir): in xDS mode Envoys report load on --envoy-xds-listen")
        return self
