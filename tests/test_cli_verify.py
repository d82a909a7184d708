"""`ome-publisher verify`: text and JSON output, the source gates by input, exit codes 0/1/2."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from publisher.cli import main
from tests.builders import make_entry, make_isvc, make_map

ROOT = Path(__file__).resolve().parent.parent
CHAT = ROOT / "examples" / "trafficmaps" / "chat.yaml"
EMBED = ROOT / "examples" / "trafficmaps" / "embed.yaml"
WRONG = ROOT / "examples" / "held" / "chat-wrong-weights.yaml"


def write(tmp_path: Path, *objects: dict[str, Any], name: str = "maps.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objects), encoding="utf-8")
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["verify", "--output", "json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_shipped_examples_are_ok(capsys) -> None:
    code, report = run_json(capsys, str(CHAT), str(EMBED))
    assert code == 0
    assert [(m["name"], m["verdict"], m["reason"], m["message"]) for m in report["maps"]] == [
        ("chat", "ok", None, None),
        ("embed", "ok", None, None),
    ]
    assert report["maps"][0]["entries"] == [
        {"cluster": "worker-a", "weight": 2, "expected": 2, "healthy": True, "expectedHealthy": True},
        {"cluster": "worker-b", "weight": 3, "expected": 3, "healthy": True, "expectedHealthy": True},
    ]
    assert [e["weight"] for e in report["maps"][1]["entries"]] == [2, 2, 0]


def test_the_wrong_copy_is_held_as_verification_failed(capsys) -> None:
    code, report = run_json(capsys, str(WRONG))
    assert code == 1
    assert report == {
        "maps": [
            {
                "namespace": "prod",
                "name": "chat",
                "verdict": "held",
                "reason": "VerificationFailed",
                "message": "entries[worker-a].weight is 1, recomputed 2",
                "entries": [
                    {"cluster": "worker-a", "weight": 1, "expected": 2, "healthy": True, "expectedHealthy": True},
                    {"cluster": "worker-b", "weight": 1, "expected": 3, "healthy": True, "expectedHealthy": True},
                ],
            }
        ]
    }


def test_text_output_shows_the_table_and_verdict(capsys) -> None:
    assert main(["verify", str(CHAT), str(WRONG)]) == 1
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["CLUSTER", "ALLOCATED", "READY", "FACTOR", "WEIGHT", "RECOMPUTED", "HEALTHY"] in lines
    assert ["worker-b", "2", "2", "3", "3", "3", "true"] in lines
    assert ["worker-b", "2", "2", "3", "1", "3", "true"] in lines
    assert "verdict: ok" in out
    assert "verdict: held, VerificationFailed: entries[worker-a].weight is 1, recomputed 2" in out
    assert "not in the input" not in out


def test_factor_shows_in_canonical_form_and_healthy_mismatch_is_marked(tmp_path, capsys) -> None:
    entries = [
        make_entry("worker-a", allocated=4, ready=4, weight=4, healthy=False),
        make_entry("worker-b", allocated=2, ready=2, factor="1.5", weight=3),
    ]
    assert main(["verify", write(tmp_path, make_map(entries=entries), make_isvc())]) == 1
    out = capsys.readouterr().out
    assert "1500m" in out
    assert "false (recomputed true)" in out
    assert "entries[worker-a].healthy is false, recomputed true" in out


def test_without_the_isvc_the_source_gates_are_skipped_and_said_so(tmp_path, capsys) -> None:
    path = write(tmp_path, make_map(observed_isvc_generation=1, status={"sourceUID": "other"}))
    assert main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert "InferenceService prod/chat is not in the input" in out
    assert "SourceUIDMismatch and ISVCGenerationMismatch not checked" in out


@pytest.mark.parametrize(
    ("tm", "isvc", "reason"),
    [
        pytest.param(make_map(status={"sourceUID": "other"}), make_isvc(), "SourceUIDMismatch", id="uid"),
        pytest.param(make_map(observed_isvc_generation=5), make_isvc(), "ISVCGenerationMismatch", id="generation"),
        pytest.param(make_map(routable=None), make_isvc(), "RoutableOutdated", id="routable"),
    ],
)
def test_with_the_isvc_the_source_gates_apply(tmp_path, capsys, tm, isvc, reason) -> None:
    code, report = run_json(capsys, write(tmp_path, isvc, tm))
    assert code == 1 and report["maps"][0]["reason"] == reason


def test_isvc_in_another_file_counts(tmp_path, capsys) -> None:
    maps = write(tmp_path, make_map(observed_isvc_generation=5), name="maps.yaml")
    isvcs = write(tmp_path, make_isvc(), name="isvcs.yaml")
    code, report = run_json(capsys, maps, isvcs)
    assert code == 1 and report["maps"][0]["reason"] == "ISVCGenerationMismatch"


@pytest.mark.parametrize(
    ("gate", "code"),
    [pytest.param("auto", 0, id="auto"), pytest.param("require", 1, id="require"), pytest.param("ignore", 0, id="ignore")],
)
def test_published_gate_flag(tmp_path, capsys, gate: str, code: int) -> None:
    assert main(["verify", "--ome-published-gate", gate, "--output", "json", str(CHAT)]) == code
    capsys.readouterr()


def test_invalid_map_lists_what_the_raw_entries_hold(tmp_path, capsys) -> None:
    entries = [make_entry("worker-a", weight=2), make_entry("worker-b", weight="3", healthy="yes"), "junk"]
    other = make_map("other")
    code, report = run_json(capsys, write(tmp_path, make_map(entries=entries), other))
    assert code == 1
    invalid, ok = report["maps"]
    assert (invalid["verdict"], invalid["reason"]) == ("held", "InvalidMap")
    assert "spec.entries[worker-b].weight" in invalid["message"]
    assert invalid["entries"] == [
        {"cluster": "worker-a", "weight": 2, "expected": None, "healthy": True, "expectedHealthy": None},
        {"cluster": "worker-b", "weight": None, "expected": None, "healthy": None, "expectedHealthy": None},
    ]
    assert (ok["name"], ok["verdict"]) == ("other", "ok")


def test_invalid_map_in_text(tmp_path, capsys) -> None:
    assert main(["verify", write(tmp_path, make_map(entries=[make_entry("worker-a", weight=-1)]))]) == 1
    out = capsys.readouterr().out
    assert "held, InvalidMap: spec.entries[worker-a].weight" in out
    assert ["worker-a", "-", "-", "-", "-1", "-", "true"] in [line.split() for line in out.splitlines()]


def test_stdin(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT.read_text(encoding="utf-8")))
    code, report = run_json(capsys, "-")
    assert code == 0 and report["maps"][0]["verdict"] == "ok"


def test_json_input_and_other_kinds_ignored(tmp_path, capsys) -> None:
    path = tmp_path / "maps.json"
    path.write_text(json.dumps({"kind": "List", "items": [{"kind": "ConfigMap", "metadata": {"name": "x"}}, make_map()]}))
    code, report = run_json(capsys, str(path))
    assert code == 0 and len(report["maps"]) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param("kind: TrafficMap\nspec: [1\n", "maps.yaml:3:", id="yaml-syntax"),
        pytest.param("kind: TrafficMap\nmetadata: {}\n", "maps.yaml: object 1 (TrafficMap) has no metadata.name", id="no-name"),
        pytest.param("kind: ConfigMap\nmetadata: {name: x}\n", "no TrafficMap in", id="no-map"),
        pytest.param(
            yaml.safe_dump(make_isvc(metadata={"generation": "6"})),
            "maps.yaml: InferenceService prod/chat: metadata.generation",
            id="bad-isvc",
        ),
    ],
)
def test_unreadable_input_exits_2_naming_the_file(tmp_path, capsys, content: str, message: str) -> None:
    path = tmp_path / "maps.yaml"
    path.write_text(content, encoding="utf-8")
    assert main(["verify", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_missing_file_exits_2(tmp_path, capsys) -> None:
    missing = str(tmp_path / "nope.yaml")
    assert main(["verify", missing]) == 2
    assert missing in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [pytest.param([], id="no-command"), pytest.param(["verify"], id="no-path"),
     pytest.param(["verify", "--output", "xml", "x"], id="bad-output")],
)
def test_usage_errors_exit_2(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("ome-publisher") is None, reason="package not installed (pip install -e .)")
def test_installed_console_script(tmp_path) -> None:
    held = subprocess.run(
        ["ome-publisher", "verify", "--output", "json", str(WRONG)], capture_output=True, text=True, timeout=60
    )
    ok = subprocess.run(["ome-publisher", "verify", str(CHAT)], capture_output=True, text=True, timeout=60)
    assert held.returncode == 1 and json.loads(held.stdout)["maps"][0]["reason"] == "VerificationFailed"
    assert ok.returncode == 0 and "verdict: ok" in ok.stdout


def test_a_hostname_annotation_that_could_change_gateway_config_is_held(tmp_path, capsys) -> None:
    """Issue 11, finding 6: verify called such a map ok because it never checked the hostname."""
    isvc = make_isvc(host="chat.example.com\n location /x { return 200 pwned; }")
    code, report = run_json(capsys, write(tmp_path, isvc, make_map()))
    assert code == 1
    (entry,) = report["maps"]
    assert entry["verdict"] == "held" and entry["reason"] == "InvalidPlan"
    assert "hostname" in entry["message"]
