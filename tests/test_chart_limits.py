"""Issue 27, item 17: the chart admitted values the sidecar refuses (`splitVerify.interval: 5s`
against a floor of 10s: the pod crash-looped after a clean install; `sharedDictSize: "32M"` or
`"10"`: the init container failed). Every limit the sidecar enforces on a value the chart passes
it is now generated from the sidecar's code (tools/chart_limits.py): the schema's patterns and the
duration ranges _validate.tpl checks. Each limit's edge is rendered by the real Helm engine: just
outside, the chart refuses it; just inside, it renders, and the rendered arguments pass the
sidecar's own parser (`run`'s, and the nginx-config init container's)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.nginx.lua_snippet import http_snippet
from publisher import cli
from publisher.cli import config
from publisher.core.durations import format_duration, parse_duration
from publisher.source.selector import SELECTOR_PATTERN, selector_problem
from tests.fakes.test_kube_api import MALFORMED_SELECTORS
from tests.test_label_selector import VALID_SELECTORS

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
sys.path.insert(0, str(ROOT / "tools"))

import chart_limits  # noqa: E402

# What else a value needs to be rendered at all (minReloadInterval only reaches NGINX reload mode).
CONTEXT: dict[str, dict[str, Any]] = {"adapter.nginx.minReloadInterval": {"adapter": {"name": "nginx", "nginx": {"mode": "reload"}}}}
NGINX_LUA = {"adapter": {"name": "nginx"}}
ENVOY_FILES = {"adapter": {"envoy": {"mode": "files"}}}


@functools.cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


def _nested(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    changes: Any = value
    for key in reversed(path.split(".")):
        changes = {key: changes}
    return _merge(base or {}, changes)


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _containers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    _chart().validate_schema(values)
    rendered = _chart().render(values, name="eu-west", namespace="ome-gateway", is_install=True)
    deployment = yaml.safe_load(rendered["ome-gateway-publisher/templates/deployment.yaml"])
    spec = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"] + spec.get("initContainers", [])}


def _refused(values: dict[str, Any]) -> str:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as refused:
        _containers(values)
    return str(refused.value)


def _run_accepts(args: list[str]) -> config.RunConfig:
    """The rendered `run` arguments through the sidecar's own parser: argparse, then the options
    model and the adapter's (what `ome-publisher run` does before it starts anything)."""
    parser, _ = cli.build_parser("run")
    parsed, unknown = parser.parse_known_args(args)
    assert not unknown, unknown
    flags = {name: value for name, value in vars(parsed).items() if name not in ("run", "parser")}
    loaded = config.load(flags, environ={})
    config.adapter_options(loaded)
    return loaded


def _nginx_config_accepts(args: list[str]) -> str:
    """The rendered nginx-config init container's arguments through its parser and the snippet's
    own checks (sizes, listen addresses, paths)."""
    parser, _ = cli.build_parser("nginx-config")
    parsed = parser.parse_args(["nginx-config", *args])
    return http_snippet(
        listen=parsed.listen, control_listen=parsed.control_listen, secret_file=Path(parsed.secret_file),
        shared_dict_size=parsed.shared_dict_size,
        counts_dict_size=None if parsed.counts_dict_size == "off" else parsed.counts_dict_size,
        ca_file=Path(parsed.ca_file) if parsed.ca_file else None, lua_dir=Path(parsed.lua_dir),
    )  # fmt: skip


# --- one source -----------------------------------------------------------------------------------


def test_the_charts_limits_are_generated_from_the_code() -> None:
    checked = subprocess.run([sys.executable, str(ROOT / "tools" / "chart_limits.py"), "--check"],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stderr


def test_the_check_sees_a_limit_that_moved(monkeypatch) -> None:
    schema = (CHART / "values.schema.json").read_text()
    assert chart_limits.schema_text(schema) == schema
    monkeypatch.setitem(chart_limits.PATTERNS, "nginxSize", "^[0-9]+m$")
    assert chart_limits.schema_text(schema) != schema
    limits = chart_limits.limits_template()
    bound = config.RunConfig.model_fields["split_interval"]
    monkeypatch.setattr(bound, "metadata", [])  # no range on the option: the generator must notice
    with pytest.raises(AssertionError):
        chart_limits.limits_template()
    assert limits == (CHART / "templates" / "_limits.tpl").read_text()


def _duration_flags_in_run_args() -> dict[str, str]:
    """Each duration option the chart passes to `run`: its values path -> the option."""
    text = (CHART / "templates" / "_run-args.tpl").read_text()
    found = {}
    direct = re.finditer(r'printf "--([a-z-]+)=%s" \.Values\.([A-Za-z.]+)', text)
    through_with = re.finditer(r'with \.Values\.([A-Za-z.]+) \}\}\n- \{\{ printf "--([a-z-]+)=%s" \. ', text)
    pairs = [(m[1], m[2]) for m in direct] + [(m[2], m[1]) for m in through_with]
    for flag, path in pairs:
        option = flag.replace("-", "_")
        info = config.RunConfig.model_fields.get(option)
        if info is not None and config.duration_range(info) is not None:
            found[path] = option
    return found


def test_every_duration_the_chart_passes_has_its_range_in_the_chart() -> None:
    passed = _duration_flags_in_run_args()
    assert {"watch.resync", "splitVerify.interval", "statusDelay"} <= set(passed)
    assert passed == chart_limits.DURATIONS


# --- each edge through Helm and the sidecar's parser -------------------------------------------


def _duration_edges() -> list[tuple[str, str, bool]]:
    """(values path, value, inside?) at each end of each range, a millisecond apart."""
    edges = []
    for limit in chart_limits.duration_limits():
        path, least, most = str(limit["path"]), float(limit["least"]), float(limit["most"])  # type: ignore[arg-type]
        edges += [(path, format_duration(most), True), (path, format_duration(most) + "1ms", False)]
        if least > 0:
            edges += [(path, format_duration(least), True), (path, format_duration(least - 0.001), False)]
        else:
            edges += [(path, "0", bool(limit["zeroOk"])), (path, "1ms", True)]
    return edges


@pytest.mark.parametrize(("path", "value", "inside"), _duration_edges(), ids=lambda v: str(v))
def test_each_duration_edge(path: str, value: str, inside: bool) -> None:
    values = _nested(path, value, CONTEXT.get(path))
    if not inside:
        _refused(values)
        return
    args = _containers(values)["publisher"]["args"]
    option = chart_limits.DURATIONS[path]
    assert f"{config.flag(option)}={value}" in args
    loaded = _run_accepts(args)
    assert getattr(loaded, option) == pytest.approx(parse_duration(value, zero_ok=True))


def test_the_issues_interval_is_refused_by_the_chart() -> None:
    assert "splitVerify.interval: 5s is shorter than 10s, the least --split-interval takes" in _refused({"splitVerify": {"interval": "5s"}})


SIZE_EDGES = [("32k", True), ("31k", False), ("999999k", True), ("1000000k", False), ("1m", True), ("1024m", True),
              ("1025m", False), ("0m", False), ("032k", False), ("32M", False), ("10", False), ("32 m", False), ("", False)]  # fmt: skip


@pytest.mark.parametrize("key", ["sharedDictSize", "countsDictSize"])
@pytest.mark.parametrize(("size", "inside"), SIZE_EDGES, ids=[size or "empty" for size, _ in SIZE_EDGES])
def test_each_shared_dict_size_edge(key: str, size: str, inside: bool) -> None:
    values = _nested(f"adapter.nginx.{key}", size, NGINX_LUA)
    if not inside:
        _refused(values)
        return
    args = _containers(values)["nginx-config"]["args"]
    flag = {"sharedDictSize": "--shared-dict-size", "countsDictSize": "--counts-dict-size"}[key]
    assert f"{flag}={size}" in args
    name = {"sharedDictSize": "ome_routes", "countsDictSize": "ome_counts"}[key]
    assert f"lua_shared_dict {name} {size};" in _nginx_config_accepts(args)


def test_counting_off_renders_and_the_init_container_takes_it() -> None:
    args = _containers(_nested("adapter.nginx.countsDictSize", "off", NGINX_LUA))["nginx-config"]["args"]
    assert "lua_shared_dict ome_counts" not in _nginx_config_accepts(args)


@pytest.mark.parametrize(
    ("ca_file", "inside"),
    [("/etc/ssl/corporate/ca.pem", True), ("/etc/ssl/my ca.pem", False), ("/etc/ssl/ca;.pem", False), ("ca.pem", False)],
    ids=["path", "space", "semicolon", "relative"],
)
def test_each_ca_file_edge(ca_file: str, inside: bool) -> None:
    values = _nested("adapter.nginx.caFile", ca_file, NGINX_LUA)
    if not inside:
        _refused(values)
        return
    assert f"proxy_ssl_trusted_certificate {ca_file};" in _nginx_config_accepts(_containers(values)["nginx-config"]["args"])


@pytest.mark.parametrize(
    ("route_config", "inside"), [("r" * 63, True), ("r" * 64, False), ("-r", False), ("r/s", False), ("ome.global_1", True)],
    ids=["63", "64", "leading-dash", "slash", "dots-underscores"],
)
def test_each_route_config_edge(route_config: str, inside: bool) -> None:
    values = _merge(ENVOY_FILES, {"adapter": {"envoy": {"mode": "files", "routeConfig": route_config}}})
    if not inside:
        _refused(values)
        return
    assert _run_accepts(_containers(values)["publisher"]["args"]).envoy_route_config == route_config


@pytest.mark.parametrize("selector", VALID_SELECTORS[2:] + MALFORMED_SELECTORS)
def test_each_label_selector_edge(selector: str) -> None:
    values = {"watch": {"labelSelector": selector}}
    if selector not in VALID_SELECTORS:
        _refused(values)
        return
    assert _run_accepts(_containers(values)["publisher"]["args"]).label_selector == selector


@settings(max_examples=200, deadline=None)
@given(st.from_regex(SELECTOR_PATTERN, fullmatch=True))
def test_every_selector_the_schema_admits_the_sidecar_takes(selector: str) -> None:
    assert selector_problem(selector) is None, selector


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab1=!(), in/.-", max_size=12))
def test_the_schema_admits_no_selector_the_sidecar_refuses(text: str) -> None:
    if re.fullmatch(SELECTOR_PATTERN, text):
        assert selector_problem(text) is None, text


HTTPROUTE = {"adapter": {"name": "httproute", "httproute": {"gateway": "gateways/global"}}}


@pytest.mark.parametrize(
    ("gateway", "inside"),
    [("gateways/global", True), ("g" * 63 + "/gw", True), ("g" * 64 + "/gw", False), ("gateways/a.b", True),
     ("gateways/a..b", False), ("gateways/a.-b", False), ("Gateways/global", False), ("gateways", False)],
    ids=["plain", "namespace-63", "namespace-64", "dotted-name", "empty-label", "label-dash", "upper-case", "no-name"],
)
def test_each_gateway_edge(gateway: str, inside: bool) -> None:
    values = _merge(HTTPROUTE, {"adapter": {"httproute": {"gateway": gateway}}})
    if not inside:
        _refused(values)
        return
    assert _run_accepts(_containers(values)["publisher"]["args"]).gateway == gateway  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("listen", "inside"), [("127.0.0.1:1", True), ("127.0.0.1:65535", True), ("127.0.0.1:65536", False), ("127.0.0.1:0", False),
                           ("localhost:8081", True), ("127.0.0.1:99999", False)],  # fmt: skip
    ids=["1", "65535", "65536", "0", "localhost", "99999"],
)
def test_each_nginx_status_listen_edge(listen: str, inside: bool) -> None:
    values = {"adapter": {"name": "nginx", "nginx": {"mode": "reload", "statusListen": listen}}}
    if not inside:
        _refused(values)
        return
    assert _run_accepts(_containers(values)["publisher"]["args"]).nginx_status_listen == listen  # type: ignore[attr-defined]


def test_the_httproute_adapters_reserved_instance_name_is_refused_by_the_chart() -> None:
    assert "would name the routes like OME's own" in _refused(_merge(HTTPROUTE, {"region": "global"}))
    with pytest.raises(config.ConfigError, match="'global' would name our routes"):
        _run_accepts(["run", "--region=global", "--adapter=httproute", "--gateway=gateways/global", "--backend-port=80"])
    # Another adapter takes the name.
    assert _run_accepts(_containers({"region": "global", "adapter": {"name": "json"}})["publisher"]["args"]).region == "global"
