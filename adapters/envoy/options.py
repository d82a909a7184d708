"""The Envoy adapter's options, both modes' (files: adapters.envoy.files; xDS: adapters.envoy.xds)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.listen import is_loopback
from adapters.timeouts import RouteIdleTimeout, RouteTimeout, route_idle_timeout_field, route_timeout_field

if TYPE_CHECKING:
    from adapters.grpc_tls import ServerTls

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
    envoy_xds_tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate (chain) the xDS and LRS servers present; with envoy_xds_tls_key and envoy_xds_client_ca "
        "they require client certificates (mutual TLS). Reread when the files change (a remounted Secret).",
    )
    envoy_xds_tls_key: Path | None = Field(default=None, description="PEM private key of envoy_xds_tls_cert, unencrypted.")
    envoy_xds_client_ca: Path | None = Field(
        default=None, description="PEM CA certificate(s) that sign the Envoys' client certificates; any other client is refused."
    )
    envoy_xds_allow_plaintext: bool = Field(
        default=False,
        description="Serve xDS and LRS without TLS on an address that is not loopback (refused otherwise: anyone who "
        "reaches the port could read every route and send load reports).",
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
        tls = (self.envoy_xds_tls_cert, self.envoy_xds_tls_key, self.envoy_xds_client_ca)
        if any(path is not None for path in tls) and any(path is None for path in tls):
            raise ValueError("give all three of --envoy-xds-tls-cert, --envoy-xds-tls-key and --envoy-xds-client-ca, or none")
        if self.envoy_xds_tls_cert is not None and self.envoy_xds_listen is None and self.envoy_lrs_listen is None:
            raise ValueError("--envoy-xds-tls-cert, --envoy-xds-tls-key and --envoy-xds-client-ca are for --envoy-xds-listen or --envoy-lrs-listen")
        if self.envoy_xds_tls_cert is None and not self.envoy_xds_allow_plaintext:
            for flag, listen in (("--envoy-xds-listen", self.envoy_xds_listen), ("--envoy-lrs-listen", self.envoy_lrs_listen)):
                if listen is not None and not is_loopback(listen.rpartition(":")[0]):
                    raise ValueError(
                        f"{flag} {listen} is not a loopback address: give --envoy-xds-tls-cert, --envoy-xds-tls-key and "
                        "--envoy-xds-client-ca (mutual TLS), or --envoy-xds-allow-plaintext"
                    )
        return self

    def load_server_tls(self) -> ServerTls | None:
        """The xDS and LRS servers' mutual TLS, its files read and checked (OSError naming the flag
        otherwise), or None for plaintext. Needs grpcio."""
        if self.envoy_xds_tls_cert is None or self.envoy_xds_tls_key is None or self.envoy_xds_client_ca is None:
            return None
        from adapters.grpc_tls import ServerTls, ServerTlsFiles  # grpcio: file mode runs without it

        return ServerTls(ServerTlsFiles(self.envoy_xds_tls_cert, self.envoy_xds_tls_key, self.envoy_xds_client_ca))
