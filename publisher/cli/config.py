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
import tempfile
from pathlib import Path
from enum import Enum
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from adapters import ADAPTERS
from publisher.core.gate import PublishedGate
from publisher.metrics import PerMap
from publisher.source.selector import selector_problem
from publisher.core.addresses import is_dns_label, split_host_port
from publisher.core.durations import DAY, DURATION_UNITS, HOUR, Duration, DurationRange, format_duration

ENV_PREFIX = "OME_PUBLISHER_"


# Every duration option is a DurationRange: Duration (longer than zero, at most a day) unless
# named here. The chart checks the values feeding them against the same ranges.
# A verdict held for more than an hour before it is written would be news too late to act on.
StatusDelay = Annotated[float, BeforeValidator(DurationRange(HOUR, zero_ok=True))]
ProbeMaxAge = Annotated[float, BeforeValidator(DurationRange(7 * DAY))]
# Envoy's load reports and NGINX's counts are read this often: at most hourly, or a window is stale.
SplitInterval = Annotated[float, BeforeValidator(DurationRange(HOUR, least=10.0, why="each report lists every map's backends"))]


class ConfigError(ValueError):
    """A bad option; the message names it as a flag."""




def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


class _RunCore(BaseModel):
    """The options of `ome-publisher run` that are not an adapter's. A field's annotation is its
    flag's choices (Literal, enum) or units (Duration); its description is the help."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: Path | None = Field(None, description="YAML file of options, keyed by long option name (e.g. `listen: 127.0.0.1:9000`).")
    region: str = Field("default", description="This region's name, a DNS label: names the status condition, its RegionReports, the field manager and the Lease.")
    name: str | None = Field(None, description="Deprecated (one release): the old spelling of --region.")
    source: str = Field("kube", description="Where TrafficMaps come from: `kube` (watch the API server) or `dir:PATH` (manifests in a directory).")
    kubeconfig: Path | None = Field(None, description="Kubeconfig of the OME control-plane cluster; default: in-cluster, else $KUBECONFIG or ~/.kube/config.")
    namespace: Annotated[tuple[str, ...], BeforeValidator(_split_list)] = Field((), description="Namespace to watch; repeat for several (default: all namespaces).")
    label_selector: str | None = Field(None, description="Only TrafficMaps and InferenceServices matching this label selector.")
    adapter: Literal[tuple(sorted(ADAPTERS))] = Field("json", description="The gateway to publish into.")  # type: ignore[valid-type]
    once: bool = Field(False, description="One full sync, then exit: 0 when every map is published, 1 when any is held or failed.")
    dry_run: bool = Field(False, description="Decide and plan one pass, print the plan, write nothing (no gateway, no status).")
    output: Literal["text", "json", "yaml"] = Field("text", description="Output format of --once and --dry-run.")
    timeout: Duration = Field(60.0, description="--once and --dry-run give up after this and exit 2, naming what they waited for (a CI gate must end).")
    source_stale_after: Duration = Field(300.0, description="Log once when no list or watch has succeeded for this long (the gateway keeps serving; the age is also a metric).")
    ome_published_gate: PublishedGate = Field(PublishedGate.AUTO, description="Honour OME's Published condition: auto, require or ignore.")
    host_template: str = Field("{name}.{namespace}", description="Hostname of a map whose InferenceService has no ome.io/global-host annotation.")
    resync: Duration = Field(60.0, description="Re-read the gateway and re-decide every map this often, repairing drift (a minute bounds how long drift lasts).")
    report_status: bool = Field(True, description="Write this instance's condition on each TrafficMap.")
    status_delay: StatusDelay = Field(
        0.5, description="A hold is news once it has stood this long (0: at once): between OME's two writes of a change a published map stays published, and a verdict other than published is written only then. The gateway never waits for it.")
    status_mode: Literal["condition", "report", "off"] = Field(
        "condition",
        description="Where this instance's verdicts go: `condition` on each TrafficMap (a few regions), `report` in this "
        "region's RegionReports beside the maps (beyond about 5 regions; needs the chart's CRD), `off` nowhere "
        "(what --no-report-status says).",
    )
    ready_without_gateway: bool = Field(
        False,
        description="Ready once synced even while no gateway client (an Envoy) is connected: for a control plane that its "
        "Envoys reach through a Service listing only ready replicas (the chart's controlPlane topology sets it).",
    )
    leader_elect: bool = Field(False, description="Only the holder of a Lease writes status; every replica still writes its own gateway.")
    lease_namespace: str | None = Field(None, description="Namespace of the Lease (default: $POD_NAMESPACE, else `default`).")
    listen: str = Field("0.0.0.0:9180", description="HOST:PORT for /metrics, /healthz, /readyz and /debug/maps (no gateway uses 9180).")
    metrics_per_map: PerMap = Field("problems", description="Which maps get per-map series (weight, map_held, map_failed): `problems` only held or failed maps, so healthy maps cost none.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Least severe level logged.")
    probe_max_age: ProbeMaxAge | None = Field(
        None, description="Report (not hold) a map whose probe.lastProbeTime is older than this.")
    split_verify: Literal["on", "off"] = Field(
        "on", description="Check the split each gateway instance serves against the weights, from the gateway's own request counts (Envoy's load reports, NGINX Lua): a report, never a hold."
    )
    split_interval: SplitInterval = Field(
        60.0, description="How often each gateway instance reports its request counts (at 10,000 maps an Envoy's report is about 1.7 MB)."
    )

    # Set by `load`: each option not given as a flag -> where its value came from, for messages.
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _name_is_the_old_region(cls, values: Any) -> Any:
        # --name, OME_PUBLISHER_NAME and the file's `name` were this option's spelling until --region.
        if isinstance(values, dict) and values.get("name") is not None:
            if not isinstance(values["name"], str) or not is_dns_label(values["name"]):
                raise ValueError(f"--name (deprecated, the old spelling of --region): {values['name']!r} is not a DNS label (lower case letters, digits, '-', at most 63)")
            region = values.get("region")
            if region is not None and region != values["name"]:
                raise ValueError(f"--name is the old spelling of --region: {values['name']!r} contradicts --region {region!r}; drop --name")
            values = {**values, "region": values["name"]}
        return values

    @field_validator("region")
    @classmethod
    def _region_is_dns_label(cls, value: str) -> str:
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

    @field_validator("label_selector")
    @classmethod
    def _label_selector_syntax(cls, value: str | None) -> str | None:
        # The API server answers a malformed selector 400 on every list: refused here, at start.
        problem = None if value is None else selector_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} is not a label selector: {problem}")
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_host_port(value)
        return value

    @model_validator(mode="after")
    def _once_without_leader_election(self) -> _RunCore:
        # A one-shot pass cannot hold a Lease meaningfully: behind a live leader it would wait for a
        # lease that is renewed forever, and taking a free one for one pass makes the leaders churn.
        if self.once and self.leader_elect and self.effective_status_mode != "off":
            raise ValueError(
                "--once cannot be combined with --leader-elect: a one-shot pass does not take the Lease; "
                "add --status-mode off to leave status to the elected replicas, or drop --leader-elect"
            )
        # The Lease lives on the API server, and only the kube source writes status.
        if self.leader_elect and self.source != "kube":
            raise ValueError(f"--leader-elect needs --source kube: with --source {self.source} there is no Lease and no status to write")
        return self

    @model_validator(mode="after")
    def _load_reports_need_the_split_check(self) -> _RunCore:
        # File mode's load report server feeds only the split check: with the check off, nothing
        # would read it, and binding its port could only fail the start.
        if self.split_verify == "off" and getattr(self, "envoy_lrs_listen", None) is not None:
            raise ValueError(
                "--envoy-lrs-listen serves only the split check, which --split-verify off turns off: drop one "
                "(and envoy-bootstrap's --lrs with --envoy-lrs-listen)"
            )
        return self

    @model_validator(mode="after")
    def _one_word_for_no_status(self) -> _RunCore:
        if not self.report_status and "status_mode" in self.model_fields_set and self.status_mode != "off":
            raise ValueError(f"--no-report-status is --status-mode off: it contradicts --status-mode {self.status_mode}; drop one")
        return self

    @property
    def effective_status_mode(self) -> str:
        """condition, report or off: --no-report-status is an older spelling of off."""
        return "off" if not self.report_status else self.status_mode

    @property
    def source_dir(self) -> Path | None:
        return Path(self.source[4:]) if self.source.startswith("dir:") else None

    @property
    def listen_address(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    def effective_lease_namespace(self) -> str:
        return self.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"




def path_problems(config: RunConfig) -> list[str]:
    """Start-up check of every file the chosen source and adapter need: inputs exist, outputs can
    be written (a file made and removed there: permissions alone do not stop root, a read-only
    mount does), NGINX's control secret is one NGINX takes. One problem per option, naming it, so a
    typo exits 2 at once instead of failing the first gateway write, or NGINX's start."""
    needed: list[tuple[str, Path | None, str]] = [("kubeconfig", config.kubeconfig, "file")]
    if config.adapter == "json":
        needed += [("json_path", config.json_path, "parent"), ("json_dir", config.json_dir, "dir")]
    elif config.adapter == "nginx":
        needed += [("nginx_conf_file", config.nginx_conf_file, "parent"), ("nginx_secret_file", config.nginx_secret_file, "secret")]
    elif config.adapter == "envoy":
        needed += [("envoy_dir", config.envoy_dir, "dir"), ("envoy_ca_file", config.envoy_ca_file, "file")]
    elif config.adapter == "httproute":
        needed.append(("gateway_kubeconfig", config.gateway_kubeconfig, "file"))
    problems = []
    for name, path, kind in needed:
        if path is None:
            continue
        problem = _path_problem(path, kind)
        if problem is not None:
            problems.append(f"{flag(name)} {path}: {problem}")
    return problems


def _path_problem(path: Path, kind: str) -> str | None:
    if kind == "file":
        return None if path.is_file() else "no such file"
    if kind == "secret":
        from adapters.nginx.lua_snippet import secret_problem

        return secret_problem(path)
    directory = path if kind == "dir" else path.absolute().parent
    if not directory.is_dir():
        return "no such directory" if kind == "dir" else f"directory {directory} does not exist"
    unwritable = _unwritable(directory)
    if unwritable is None:
        return None
    return f"cannot write there: {unwritable}" if kind == "dir" else f"cannot write in {directory}: {unwritable}"


def _unwritable(directory: Path) -> str | None:
    """Why no file can be made in `directory`, or None."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".ome-publisher-check-"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


# Short spellings kubectl users expect.
_SHORT_FLAGS = {"output": "-o", "namespace": "-n"}


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


def duration_range(info: FieldInfo) -> DurationRange | None:
    """The DurationRange of a duration option (through Optional), else None."""
    validators = list(info.metadata)
    for arg in get_args(info.annotation):
        validators.extend(getattr(arg, "__metadata__", ()))
    return next((v.func for v in validators if isinstance(v, BeforeValidator) and isinstance(v.func, DurationRange)), None)


def _with_adapter_options(core: type[_RunCore]) -> type[_RunCore]:
    """`core` plus every adapter's options, taken from the adapters' own options models: a new
    adapter's options reach the flags, the environment and the config file with no edit here.
    Each is unset (None) unless given, so the adapter's own defaults and rules apply when
    `app.build_adapter` validates its options model; a switch (bool) keeps its default."""
    users: dict[str, list[str]] = {}
    infos: dict[str, FieldInfo] = {}
    for adapter_name, spec in sorted(ADAPTERS.items()):
        for name, info in spec.options.model_fields.items():
            if name in core.model_fields:
                continue  # httproute's `region` is this --region
            users.setdefault(name, []).append(adapter_name)
            infos.setdefault(name, info)
    fields: dict[str, Any] = {}
    for name, info in infos.items():
        adapters = users[name]
        prefix = f"{' and '.join(adapters)} adapter{'s' if len(adapters) > 1 else ''}: "
        annotation = info.rebuild_annotation()
        if annotation is bool:
            fields[name] = (bool, Field(info.default, description=prefix + (info.description or "")))
            continue
        # The help shows the adapter's own default; the field stays None so that default applies.
        shown = None if info.is_required() or info.default is None else info.default
        extra = {"adapter_default": shown} if shown is not None else None
        fields[name] = (Optional[annotation], Field(None, description=prefix + (info.description or ""), json_schema_extra=extra))  # noqa: UP007
    return create_model("RunConfig", __base__=core, __doc__="Every option of `ome-publisher run`.", **fields)


RunConfig = _with_adapter_options(_RunCore)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argparse option per RunConfig field; absent options stay absent (SUPPRESS), so the
    merge can tell a flag from a default. Help shows choices, units and the default."""
    for name, info in RunConfig.model_fields.items():
        default = info.default
        if default is None and isinstance(info.json_schema_extra, dict):
            default = info.json_schema_extra.get("adapter_default")
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
        bound = duration_range(info)
        duration = bound is not None
        if isinstance(default, Enum):
            default = default.value
        notes = [DURATION_UNITS, bound.describe()] if bound is not None else []
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


def _from_file(path: Path) -> dict[str, tuple[str, Any]]:
    """Each option the file sets: its field name -> (the key as written, the value)."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: {' '.join(str(exc).split())}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    values: dict[str, tuple[str, Any]] = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in RunConfig.model_fields or name == "config":
            raise ConfigError(f"--config {path}: unknown option {key!r}")
        values[name] = (str(key), value)
    return values


def load(flags: dict[str, Any], environ: dict[str, str] | None = None) -> RunConfig:
    """Merge file < environment < flags and validate, the chosen adapter's options included.
    Raises ConfigError naming each bad option as a flag, and where its value came from when that
    was the environment or the file."""
    environ = dict(os.environ) if environ is None else environ
    from_env = _from_environment(environ)
    config_path = flags.get("config") or from_env.get("config")
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}  # an option not set by its flag: where its value came from
    if config_path:
        for name, (key, value) in _from_file(Path(config_path)).items():
            merged[name] = value
            origins[name] = f"key {key} of {config_path}"
    merged.update(from_env)
    origins.update({name: f"from {env_var(name)}" for name in from_env})
    merged.update(flags)
    for name in flags:
        origins.pop(name, None)
    try:
        config = RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, origins)) from exc
    config._origins.update(origins)
    return config


def adapter_options(config: RunConfig) -> Any:
    """The chosen adapter's options model, validated with the values `config` has for it; a
    ConfigError names the options as `load` does."""
    options_model = ADAPTERS[config.adapter].options
    values = {name: getattr(config, name) for name in options_model.model_fields if getattr(config, name, None) is not None}
    try:
        return options_model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"--adapter {config.adapter}: {describe_errors(exc, config._origins)}") from exc


# A field name as a message may mention it: lower-case words joined by underscores.
_FIELD_NAME = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def describe_errors(exc: ValidationError, origins: dict[str, str]) -> str:
    """pydantic's errors in the words of the command line: flags for field names, no "Value
    error," prefix, and the environment variable or file key a value came from."""

    def in_flags(text: str) -> str:
        return _FIELD_NAME.sub(lambda m: flag(m.group()) if m.group() in RunConfig.model_fields else m.group(), text)

    def named(name: str) -> str:
        return f"{flag(name)} ({origins[name]})" if name in origins else flag(name)

    problems = []
    for error in exc.errors():
        message = "required" if error["type"] == "missing" else in_flags(str(error["msg"]).removeprefix("Value error, "))
        name = str(error["loc"][0]) if error["loc"] else None
        if name is not None:
            problems.append(f"{named(name) if name in RunConfig.model_fields else name}: {message}")
            continue
        # A rule about several options: say where those not given as flags came from.
        mentioned = [n for n in origins if re.search(rf"{re.escape(flag(n))}\b(?!-)", message)]
        problems.append(message + (f" ({', '.join(f'{flag(n)} {origins[n]}' for n in mentioned)})" if mentioned else ""))
    return "; ".join(problems)
