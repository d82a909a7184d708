"""Issue 23, point 7: start-up refusals in the user's words. Each names the flag (never the model's
field name, never pydantic's "Value error,") and, when the value came from one, the environment
variable or the config file's key; no exception repr reaches a message; a misspelt flag of `run`
gets `run`'s usage and the flag that was probably meant."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from publisher.cli import main
from publisher.core.durations import parse_duration
from tests.gateways import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "trafficmaps"
ONE_PASS = ["--source", f"dir:{EXAMPLES}", "--once"]
# What may not appear in what a user reads: pydantic's prefix, a field name, an exception's repr.
CODE_WORDS = re.compile(r"Value error|[a-z]+_[a-z_]+|[A-Z][A-Za-z]+(Error|Key)\(")


def _duration_refusal(text: str) -> str:
    try:
        parse_duration(text)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{text!r} parsed")


NOT_A_DURATION = _duration_refusal("soon")


def refusal(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ome-publisher run: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--adapter", "nginx"], "--adapter nginx: --nginx-mode lua needs --nginx-secret-file"),
        (["--adapter", "nginx", "--nginx-mode", "reload"], "--adapter nginx: --nginx-mode reload needs --nginx-conf-file"),
        (["--adapter", "envoy", "--envoy-xds-listen", "foo"], "--envoy-xds-listen: 'foo' is not HOST:PORT"),
        (["--adapter", "httproute"], "--adapter httproute: --gateway: required; --backend-port: required"),
    ],
    ids=["nginx-lua-secret", "nginx-reload-conf", "envoy-xds-listen", "httproute-required"],
)
def test_adapter_option_refusals_name_flags(capsys, tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    line = refusal(capsys, ["run", *ONE_PASS, *args])
    assert expected in line
    assert not CODE_WORDS.search(line.removeprefix("ome-publisher run: ")), line


def test_a_bad_value_from_the_environment_names_the_variable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OME_PUBLISHER_RESYNC", "soon")
    line = refusal(capsys, ["run", *ONE_PASS, "--json-path", str(tmp_path / "o.json")])
    assert line == f"ome-publisher run: --resync (from OME_PUBLISHER_RESYNC): {NOT_A_DURATION}"


def test_a_bad_adapter_value_from_the_environment_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("OME_PUBLISHER_ENVOY_XDS_LISTEN", "foo")
    line = refusal(capsys, ["run", *ONE_PASS, "--adapter", "envoy"])
    assert line == "ome-publisher run: --adapter envoy: --envoy-xds-listen (from OME_PUBLISHER_ENVOY_XDS_LISTEN): 'foo' is not HOST:PORT"


def test_a_flag_beats_the_environment_and_is_blamed_itself(capsys, monkeypatch):
    monkeypatch.setenv("OME_PUBLISHER_RESYNC", "1m")
    line = refusal(capsys, ["run", *ONE_PASS, "--resync", "soon"])
    assert line.startswith("ome-publisher run: --resync: 'soon'")


def test_a_bad_value_from_the_config_file_names_the_key_and_the_file(capsys, tmp_path):
    file = tmp_path / "publisher.yaml"
    file.write_text("resync: soon\njson-path: out.json\n")
    line = refusal(capsys, ["run", *ONE_PASS, "--config", str(file)])
    assert line == f"ome-publisher run: --resync (key resync of {file}): {NOT_A_DURATION}"


def test_a_combination_from_several_places_names_where_each_came_from(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OME_PUBLISHER_JSON_DIR", str(tmp_path))
    line = refusal(capsys, ["run", *ONE_PASS, "--json-path", str(tmp_path / "o.json")])
    assert line == (
        "ome-publisher run: --adapter json: give exactly one of --json-path and --json-dir "
        "(--json-dir from OME_PUBLISHER_JSON_DIR)"
    )


def test_a_misspelt_flag_of_run_gets_runs_usage_and_the_closest_flag(capsys):
    assert main(["run", "--nginx-secrt-file", "/run/ome/secret"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ome-publisher run ")
    assert err.strip().splitlines()[-1] == (
        "ome-publisher run: error: unrecognized arguments: --nginx-secrt-file /run/ome/secret (did you mean --nginx-secret-file?)"
    )


def test_an_unreachable_gateway_is_named_by_host_and_port_not_by_an_exception_repr(capsys, tmp_path):
    port = free_port()  # nothing listens there
    code = main(["run", *ONE_PASS, "--adapter", "envoy", "--envoy-dir", str(tmp_path),
                 "--envoy-admin", f"http://127.0.0.1:{port}", "--timeout", "5s"])
    out = capsys.readouterr().out
    assert code == 1, out
    held = [line for line in out.splitlines() if "ApplyFailed" in line]
    assert held, out
    for line in held:
        assert f"127.0.0.1:{port}: Connection refused" in line, line
        assert not re.search(r"[A-Z][A-Za-z]+(Error|Key)\(", line), line


def test_a_missing_reload_command_is_named_by_its_path(capsys, tmp_path):
    missing = tmp_path / "no-such-nginx"
    code = main(["run", *ONE_PASS, "--adapter", "nginx", "--nginx-conf-file", str(tmp_path / "ome.conf"),
                 "--nginx-reload-cmd", str(missing), "--nginx-status-listen", f"127.0.0.1:{free_port()}", "--timeout", "5s"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (1, 2), text
    assert f"{missing}: No such file or directory" in text, text
    assert "FileNotFoundError(" not in text, text
