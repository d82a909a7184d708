"""One duration grammar (issue 23, finding 1): the chart's values schema admitted `1m30s` and
`1h30m`, the sidecar refused them and exited 2, so `helm install` succeeded and the pod
crash-looped. Now the schema's `duration` definition is the binary's DURATION_PATTERN: every
string the schema admits the binary parses (generated from the pattern), every example the docs
give the schema admits, and a chart rendered with such durations starts the sidecar."""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from publisher.cli import config
from publisher.cli import main
from publisher.core.durations import DURATION_EXAMPLES, DURATION_PATTERN, parse_duration
from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# Where the chart's values take a duration the sidecar parses (not the Prometheus ones).
SIDECAR_DURATIONS = {
    ("watch", "resync"): "positiveDuration",
    ("gates", "probeMaxAge"): "positiveDuration",
    ("adapter", "nginx", "minReloadInterval"): "duration",
}


def _definition(name: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator({**SCHEMA["definitions"][name], "definitions": SCHEMA["definitions"]})


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    changes: Any = value
    for key in reversed(path):
        changes = {key: changes}
    return changes


@functools.cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


def test_the_schema_has_one_duration_definition_and_it_is_the_binarys() -> None:
    assert SCHEMA["definitions"]["duration"]["pattern"] == DURATION_PATTERN
    text = (CHART / "values.schema.json").read_text()
    # Every sidecar duration refers to it; no other copy of the pattern.
    assert text.count(json.dumps(DURATION_PATTERN)) == 1
    for path, definition in SIDECAR_DURATIONS.items():
        node: Any = SCHEMA
        for key in path:
            node = node["properties"][key]
        assert f"#/definitions/{definition}" in json.dumps(node), path


@settings(max_examples=300, deadline=None)
@given(st.from_regex(DURATION_PATTERN, fullmatch=True).filter(bool))
def test_every_duration_the_schema_admits_the_binary_parses(text: str) -> None:
    if _definition("duration").is_valid(text):
        seconds = parse_duration(text, zero_ok=True)
        assert seconds >= 0
        # A positive duration (resync, probeMaxAge) is one with a non-zero digit: exactly the
        # strings the binary's longer-than-zero check passes.
        assert _definition("positiveDuration").is_valid(text) == (seconds > 0)
        if seconds > 0:
            assert parse_duration(text) == seconds


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.hmsd -", max_size=8))
def test_the_schema_and_the_binary_refuse_the_same_strings(text: str) -> None:
    try:
        parse_duration(text.strip(), zero_ok=True)
        parsed = True
    except ValueError:
        parsed = False
    assert _definition("duration").is_valid(text.strip()) == parsed, text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1m30s", 90.0), ("1h30m", 5400.0), ("500ms", 0.5), ("2m", 120.0), ("60s", 60.0), ("1h", 3600.0),
     ("1.5s", 1.5), ("1h0m0s", 3600.0), ("2h45m30.5s", 9930.5), ("1m500ms", 60.5)],
)
def test_go_style_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert _definition("positiveDuration").is_valid(text)


@pytest.mark.parametrize("text", ["60", "1.5", "1d", "1s1m", "30s30s", "1.s", ".5s", "-1s", "1 m", "1µs", "1ns", "", "0s0m"])
def test_both_refuse(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
    assert not _definition("positiveDuration").is_valid(text)


def _documented_examples() -> set[str]:
    """Every duration the docs show: the help's examples, README's, and values.yaml's."""
    shown = {part.strip() for part in DURATION_EXAMPLES.split(",")}
    readme = (ROOT / "README.md").read_text()
    sentence = readme[readme.index("Durations are"):].split("\n\n")[0]
    shown |= set(re.findall(r"`([0-9][0-9a-z.]*)`", sentence))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in SIDECAR_DURATIONS:
        node: Any = values
        for key in path:
            node = node[key]
        if node:
            shown.add(node)
    return shown


def test_every_documented_duration_is_admitted_by_the_schema_and_the_binary() -> None:
    examples = _documented_examples()
    assert {"1m30s", "1h30m", "500ms"} <= examples, examples
    for example in examples:
        # `0` is documented for the options that allow no wait (minReloadInterval), not the others.
        zero = example == "0"
        assert parse_duration(example, zero_ok=zero) >= 0, example
        for path, definition in SIDECAR_DURATIONS.items():
            if zero and definition == "positiveDuration":
                with pytest.raises(helm.HelmValuesError):
                    _chart().validate_schema(_nested(path, example))
            else:
                _chart().validate_schema(_nested(path, example))


def test_run_help_shows_the_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "--resync DURATION" in text and DURATION_EXAMPLES in text


def test_a_go_style_duration_reads_from_every_spelling(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("resync: 1m30s\n")
    assert config.load({"config": str(file)}, environ={}).resync == 90.0
    assert config.load({}, environ={"OME_PUBLISHER_PROBE_MAX_AGE": "1h30m"}).probe_max_age == 5400.0
    assert config.load({"timeout": "2m30s"}, environ={}).timeout == 150.0


# --- end to end: render the chart, start the sidecar with the rendered arguments ------------------


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _publisher_args(changes: dict[str, Any]) -> list[str]:
    rendered = _chart().render(changes, name="eu-west", namespace="ome-gateway", is_install=True)
    deployment = yaml.safe_load(rendered["ome-gateway-publisher/templates/deployment.yaml"])
    spec = deployment["spec"]["template"]["spec"]
    (publisher,) = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == "publisher"]
    return publisher["args"]


DURATIONS = {"watch": {"resync": "1m30s"}, "gates": {"probeMaxAge": "1h30m"}}


@pytest.mark.parametrize(
    "changes",
    [
        {"adapter": {"name": "json"}},
        {"adapter": {"name": "nginx", "nginx": {"mode": "reload", "minReloadInterval": "1.5s"}}},
        {"adapter": {"name": "json"}, "watch": {"resync": "2h45m30.5s"}, "gates": {"probeMaxAge": "500ms"}},
    ],
    ids=["json", "nginx-reload", "more-forms"],
)
def test_the_sidecar_starts_with_the_durations_the_chart_renders(tmp_path: Path, changes: dict[str, Any]) -> None:
    values = _merge(DURATIONS, changes)
    args = _publisher_args(values)
    assert f"--resync={values['watch']['resync']}" in args and f"--probe-max-age={values['gates']['probeMaxAge']}" in args
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map(entries=[make_entry("worker-a", weight=1)])]))
    gateway = tmp_path / "gateway"
    (gateway / "maps").mkdir(parents=True)
    # The pod's paths moved under tmp_path; the control plane replaced by a directory of maps.
    local = [arg.replace("/run/ome-gateway", str(gateway)) for arg in args if not arg.startswith(("--kubeconfig=", "--source="))]
    command = [*local, f"--source=dir:{maps}", f"--listen=127.0.0.1:{free_port()}", "--dry-run"]
    script = "import sys; sys.argv[0] = 'ome-publisher'; from publisher.cli import main; sys.exit(main())"
    started = subprocess.run([sys.executable, "-c", script, *command], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert started.returncode == 0, started.stderr
    assert "would publish 1 map(s)" in started.stdout
