"""The NGINX adapter's options, both modes' (reload: adapters.nginx.reload; Lua: adapters.nginx.lua)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from adapters.listen import check_nginx_listen, nginx_listen_parts
from adapters.timeouts import RouteIdleTimeout, route_idle_timeout_field
from publisher.core.durations import Interval

__all__ = ["VERSION_PATH", "NginxOptions"]

# Where reload mode's status listener serves the version of the file NGINX loaded.
VERSION_PATH = "/.well-known/ome-gateway-publisher/version"

_ListenAddress = Annotated[str, AfterValidator(check_nginx_listen)]


class NginxOptions(BaseModel):
    """How the NGINX adapter reaches its NGINX. Lua mode: nginx_secret_file (and nginx_control_url).
    Reload mode: nginx_conf_file and exactly one of nginx_pid_file, nginx_reload_cmd."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nginx_mode: Literal["lua", "reload"] | None = Field(
        default=None,
        description="lua: weights pushed into the running NGINX, no reloads; reload: rewrite a file and reload. "
        "Unset, it is reload when --nginx-conf-file is given (the sidecar cannot see NGINX's modules), else lua.",
    )
    nginx_control_url: str = Field(
        default="http://127.0.0.1:8082",
        pattern=r"^https?://[A-Za-z0-9.:\[\]-]+(:[0-9]{1,5})?/?$",
        description="Lua mode: the control listener `ome-publisher nginx-config` declares; loopback, inside the pod.",
    )
    nginx_secret_file: Path | None = Field(
        default=None, description="Lua mode: the shared secret the control listener requires, read by both sides."
    )
    nginx_conf_file: Path | None = Field(
        default=None,
        description="Reload mode: the one file the adapter owns, included inside http {}; no default: it is deployment-specific.",
    )
    nginx_listen: _ListenAddress = Field(
        default="8080", description="Where published hostnames are served; 8080 needs no root, like OME's examples."
    )
    nginx_pid_file: Path | None = Field(
        default=None, description="SIGHUP the master named here; for a sidecar sharing the process namespace."
    )
    nginx_reload_cmd: str | None = Field(
        default=None, description="Run (no shell) to reload when no PID file is shared, e.g. `nginx -s reload`."
    )
    nginx_test_cmd: str | None = Field(
        default=None, description="Run (no shell) to validate before reloading; unset, a bad map is caught only after."
    )
    nginx_status_listen: _ListenAddress = Field(
        default="127.0.0.1:8081", description="Serves the file's version; loopback, as only the sidecar reads it."
    )
    nginx_min_reload_interval: Interval = Field(
        default=2.0,
        description="Reloads cut streams after worker_shutdown_timeout; 2s bounds that to a few per minute at most.",
    )
    rewrite_host: bool = Field(
        default=False, description="Off: the client's Host passes through, as OME's own publisher does."
    )
    route_idle_timeout: RouteIdleTimeout = route_idle_timeout_field()

    @model_validator(mode="before")
    @classmethod
    def _mode_from_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("nginx_mode") is None:
            data = {**data, "nginx_mode": "reload" if data.get("nginx_conf_file") is not None else "lua"}
        return data

    @model_validator(mode="after")
    def _one_reload_way(self) -> NginxOptions:
        if self.nginx_mode == "lua":
            if self.nginx_secret_file is None:
                raise ValueError("nginx_mode lua needs nginx_secret_file")
            if "route_idle_timeout" in self.model_fields_set:
                # Lua mode pushes weights only: the timeouts are in the snippet NGINX loads.
                raise ValueError("nginx_mode lua takes its idle timeout from `ome-publisher nginx-config --route-idle-timeout`, "
                                 "not from route_idle_timeout")
            return self
        if self.nginx_conf_file is None:
            raise ValueError("nginx_mode reload needs nginx_conf_file")
        if (self.nginx_pid_file is None) == (self.nginx_reload_cmd is None):
            raise ValueError("set exactly one of nginx_pid_file and nginx_reload_cmd")
        if self.nginx_listen == self.nginx_status_listen:
            raise ValueError("nginx_listen and nginx_status_listen must differ")
        return self

    @property
    def status_url(self) -> str:
        host, port = nginx_listen_parts(self.nginx_status_listen)  # validated above
        host = host or "127.0.0.1"
        host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        return f"http://{host}:{port}{VERSION_PATH}"
