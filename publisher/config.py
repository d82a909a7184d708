"""Configuration of `ome-publisher run`: one pydantic model, three spellings of each option.

A field `json_path` is the flag `--json-path`, the environment variable `OME_PUBLISHER_JSON_PATH`
and the key `json-path` of a `--config` YAML file. Flags beat the environment, which beats the
file. The argparse options are generated from the model, so the help, the validation and the
Helm chart's arguments cannot drift apart. Each default says why it is what it is.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from publisher.gate import PublishedGate
from publisher.metrics import PerMap
from publisher.model import is_dns_label

ENV_PREFIX = "OME_PUBLISHER_"
_DURATION = re.compile(r"^(?P<value>[0-9]+(\.[0-9]+)?)(?P<unit>ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """A bad option; the message names it as a flag."""


def parse_duration(value: Any) -> float:
    """'60s', '500ms', '2m', '1h' or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise ValueError(f"{value!r} is not a duration such as 500ms, 60s or 2m")
        seconds = float(match["value"]) * _UNITS[match["unit"]]
    if seconds <= 0:
        raise ValueError(f"{value!r} must be longer than zero")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


class RunConfig(BaseModel):
    """Every option of `ome-publisher run`. A field's annotation is its flag's choices (Literal,
    enum) or units (Duration); its description is the help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: Path | None = Field(None, description="YAML file of options, keyed by long option name (e.g. `listen: 127.0.0.1:9000`).")
    name: str = Field("default", description="Instance name, a DNS label (e.g. the region): names the status condition, field manager and Lease.")
    source: str = Field("kube", description="Where TrafficMaps come from: `kube` (watch the API server) or `dir:PATH` (manifests in a directory).")
    kubeconfig: Path | None = Field(None, description="Kubeconfig of the OME control-plane cluster; default: in-cluster, else $KUBECONFIG or ~/.kube/config.")
    namespace: Annotated[tuple[str, ...], BeforeValidator(_split_list)] = Field((), description="Namespace to watch; repeat for several (default: all namespaces).")
    label_selector: str | None = Field(None, description="Only TrafficMaps and InferenceServices matching this label selector.")
    adapter: Literal["envoy", "httproute", "json", "nginx"] = Field("json", description="The gateway to publish into.")
    once: bool = Field(False, description="One full sync, then exit: 0 when every map is published, 1 when any is held or failed.")
    dry_run: bool = Field(False, description="Decide and plan one pass, print the plan, write nothing (no gateway, no status).")
    output: Literal["text", "json", "yaml"] = Field("text", description="Output format of --once and --dry-run.")
    ome_published_gate: PublishedGate = Field(PublishedGate.AUTO, description="Honour OME's Published condition: auto, require or ignore.")
    host_template: str = Field("{name}.{namespace}", description="Hostname of a map whose InferenceService has no ome.io/global-host annotation.")
    resync: Duration = Field(60.0, description="Re-read the gateway and re-decide every map this often, repairing drift (a minute bounds how long drift lasts).")
    report_status: bool = Field(True, description="Write this instance's condition on each TrafficMap.")
    leader_elect: bool = Field(False, description="Only the holder of a Lease writes status; every replica still writes its own gateway.")
    lease_namespace: str | None = Field(None, description="Namespace of the Lease (default: $POD_NAMESPACE, else `default`).")
    listen: str = Field("0.0.0.0:9180", description="HOST:PORT for /metrics, /healthz, /readyz and /debug/maps (no gateway uses 9180).")
    metrics_per_map: PerMap = Field("problems", description="Which maps get per-map series (weight, map_held, map_failed): `problems` only held or failed maps, so healthy maps cost none.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe level logged.")
    probe_max_age: Duration | None = Field(None, description="Report (not hold) a map whose probe.lastProbeTime is older than this.")
    json_path: Path | None = Field(None, description="json adapter: one file holding every route, rewritten whole on each change (small fleets).")
    json_dir: Path | None = Field(None, description="json adapter: a directory with one file per map, O(1) per change (large fleets).")
    envoy_dir: Path | None = Field(None, description="envoy adapter: directory of cds.yaml and rds.yaml that Envoy watches.")
    envoy_route_config: str = Field("ome-global", description="envoy adapter: name of the route configuration in rds.yaml.")
    envoy_admin: str | None = Field(None, description="envoy adapter: admin URL, to confirm Envoy took each version.")
    envoy_ca_file: Path | None = Field(None, description="envoy adapter: CA bundle for https endpoints (default: the system trust store).")
    rewrite_host: bool = Field(False, description="envoy and nginx adapters: send each backend its endpoint's host as the Host header.")
    nginx_mode: Literal["lua", "reload"] | None = Field(None, description="nginx adapter: lua (pushes into the running NGINX, no reloads) or reload; unset: reload when --nginx-conf-file is given, else lua.")
    nginx_control_url: str | None = Field(None, description="nginx adapter, Lua mode: the control listener (default http://127.0.0.1:8082).")
    nginx_secret_file: Path | None = Field(None, description="nginx adapter, Lua mode: the shared secret file the control listener requires.")
    nginx_conf_file: Path | None = Field(None, description="nginx adapter: the file it owns, included inside http {}.")
    nginx_listen: str = Field("8080", description="nginx adapter: listen address of the published servers.")
    nginx_pid_file: Path | None = Field(None, description="nginx adapter: master PID file; reload by SIGHUP.")
    nginx_reload_cmd: str | None = Field(None, description="nginx adapter: reload command, run without a shell.")
    nginx_test_cmd: str | None = Field(None, description="nginx adapter: validation command run before each reload (e.g. `nginx -t -c ...`).")
    nginx_status_listen: str = Field("127.0.0.1:8081", description="nginx adapter: where NGINX serves the config version the adapter waits for.")
    nginx_min_reload_interval: Duration = Field(2.0, description="nginx adapter: at most one reload per interval (reloads cut long streams).")
    gateway_kubeconfig: Path | None = Field(None, description="httproute adapter: kubeconfig of the gateway's cluster (default: in-cluster).")
    gateway: str | None = Field(None, description="httproute adapter: the parent Gateway, NAMESPACE/NAME.")
    backend_port: int | None = Field(None, description="httproute adapter: port of each backend's ExternalName Service.")
    route_namespace: str | None = Field(None, description="httproute adapter: namespace of the routes (default: the map's).")
    route_status_timeout: Duration = Field(5.0, description="httproute adapter: how long to wait for the gateway to report on a route before publishing with a note.")

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, value: str) -> str:
        if not is_dns_label(value):
            raise ValueError(f"{value!r} is not a DNS label (lower case letters, digits, '-', at most 63)")
        return value

    @field_validator("source")
    @classmethod
    def _source_form(cls, value: str) -> str:
        if value != "kube" and not (value.startswith("dir:") and len(value) > 4):
            raise ValueError(f"{value!r} is neither `kube` nor `dir:PATH`")
        return value

    @field_validator("host_template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        try:
            value.format(name="n", namespace="ns")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{value!r} may use only {{name}} and {{namespace}}") from exc
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_host_port(value)
        return value

    @property
    def source_dir(self) -> Path | None:
        return Path(self.source[4:]) if self.source.startswith("dir:") else None

    @property
    def listen_address(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    def effective_lease_namespace(self) -> str:
        return self.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


# Short spellings kubectl users expect.
_SHORT_FLAGS = {"output": "-o", "namespace": "-n"}
DURATION_UNITS = "a duration: 500ms, 60s, 2m, 1h"


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a Literal or enum annotation allows (through Optional), else None."""
    if get_origin(annotation) is Union:
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        return _choices(inner[0]) if len(inner) == 1 else None
    if get_origin(annotation) is Literal:
        return tuple(str(value) for value in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return tuple(str(member.value) for member in annotation)
    return None


def _is_duration(annotation: Any, metadata: list[Any]) -> bool:
    validators = list(metadata)
    for arg in get_args(annotation):
        validators.extend(getattr(arg, "__metadata__", ()))
    return any(isinstance(v, BeforeValidator) and v.func is parse_duration for v in validators)


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argparse option per RunConfig field; absent options stay absent (SUPPRESS), so the
    merge can tell a flag from a default. Help shows choices, units and the default."""
    for name, info in RunConfig.model_fields.items():
        default = info.default
        help_text = info.description or ""
        flags = ([_SHORT_FLAGS[name]] if name in _SHORT_FLAGS else []) + [flag(name)]
        if info.annotation is bool and default is True:
            parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text + " (default: on)")
            continue
        if info.annotation is bool:
            parser.add_argument(flag(name), dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
            continue
        if name == "namespace":
            parser.add_argument(*flags, dest=name, action="append", default=argparse.SUPPRESS, metavar="NS", help=help_text)
            continue
        choices = _choices(info.annotation)
        duration = _is_duration(info.annotation, info.metadata)
        if isinstance(default, Enum):
            default = default.value
        notes = [DURATION_UNITS] if duration else []
        if default not in (None, ()):
            notes.append(f"default: {format_duration(default) if duration else default}")
        if notes:
            help_text += f" ({'; '.join(notes)})"
        metavar = "DURATION" if duration else "{" + ",".join(choices) + "}" if choices else name.split("_")[-1].upper()
        parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, choices=choices, metavar=metavar, help=help_text)


def _from_environment(environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in RunConfig.model_fields:
        raw = environ.get(env_var(name))
        if raw is not None:
            values[name] = raw
    return values


def _from_file(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    values: dict[str, Any] = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in RunConfig.model_fields or name == "config":
            raise ConfigError(f"--config {path}: unknown option {key!r}")
        values[name] = value
    return values


def load(flags: dict[str, Any], environ: dict[str, str] | None = None) -> RunConfig:
    """Merge file < environment < flags and validate. Raises ConfigError naming the option."""
    environ = dict(os.environ) if environ is None else environ
    from_env = _from_environment(environ)
    config_path = flags.get("config") or from_env.get("config")
    merged: dict[str, Any] = {}
    if config_path:
        merged.update(_from_file(Path(config_path)))
    merged.update(from_env)
    merged.update(flags)
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "?"
            shown = flag(name) if name in RunConfig.model_fields else name
            problems.append(f"{shown}: {error['msg']}")
        raise ConfigError("; ".join(problems)) from exc
