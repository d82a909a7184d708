"""Finding 4 of issue 14: the CLI fits kubectl habits: --version, -o json|yaml|text wherever output
is printed, help that lists each option's choices and units and reads right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from publisher import __version__
from publisher.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHAT = EXAMPLES / "trafficmaps" / "chat.yaml"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ome-publisher {__version__}"


@pytest.mark.parametrize("spelling", ["-o", "--output"])
def test_verify_prints_yaml_equal_to_its_json(capsys, spelling):
    assert main(["verify", "-o", "json", str(CHAT)]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert main(["verify", spelling, "yaml", str(CHAT)]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == as_json


@pytest.mark.parametrize("mode", ["--once", "--dry-run"])
def test_run_prints_yaml_equal_to_its_json(tmp_path, capsys, mode):
    argv = ["run", "--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--adapter", "json", "--json-path", str(tmp_path / "o.json"), mode]
    assert main([*argv, "-o", "json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert main([*argv, "-o", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == as_json
    assert [p["name"] for p in as_json["publications"]] == ["chat", "embed"]


def help_of(capsys, *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    # argparse wraps at the terminal width: join the lines to read each option's help whole.
    return re.sub(r"\s+", " ", capsys.readouterr().out)


def test_run_help_lists_choices_and_units(capsys):
    text = help_of(capsys, "run")
    for shown in ("--adapter {envoy,httproute,json,nginx}", "-o {text,json,yaml}, --output {text,json,yaml}",
                  "--log-format {text,json}", "--log-level {debug,info,warning,error}",
                  "--ome-published-gate {auto,require,ignore}", "--metrics-per-map {all,problems,none}"):
        assert shown in text, shown
    for duration, span, default in (("--resync", "at most 24h", "1m"), ("--nginx-min-reload-interval", "0 to 24h", "2s"),
                                    ("--route-status-timeout", "at most 24h", "5s"), ("--split-interval", "10s to 1h", "1m")):
        assert re.search(rf"{duration} DURATION .*?\(a duration: 1h30m, 2m, 60s, 1\.5s, 500ms; {span}; default: {default}\)", text), duration
    assert re.search(r"--probe-max-age DURATION .*?\(a duration: 1h30m, 2m, 60s, 1\.5s, 500ms; at most 168h\)", text)


def test_report_status_help_reads_right(capsys):
    text = help_of(capsys, "run")
    assert "--report-status, --no-report-status Write this instance's condition on each TrafficMap. (default: on)" in text
    assert "turn off with" not in text


def test_an_unknown_choice_is_a_usage_error_naming_the_choices(capsys):
    assert main(["run", "--adapter", "haproxy"]) == 2
    assert "choose from envoy, httproute, json, nginx" in capsys.readouterr().err.replace("'", "")


def test_verify_help_shows_both_modes(capsys):
    text = help_of(capsys, "verify")
    for shown in ("-o {text,json,yaml}, --output {text,json,yaml}", "--kubeconfig KUBECONFIG", "-n NS, --namespace NS", "PATH|NAME"):
        assert shown in text, shown
