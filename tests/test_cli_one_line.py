"""Issue 27, item 18: one line means one line. A taken --envoy-xds-listen / --envoy-lrs-listen printed
gRPC's own lines before ours; `--status-delay -1s` answered argparse's "expected one argument";
`--status-delay 100000000h` was accepted (a held verdict would never be written); --once's timeout
message repeated itself; --envoy-lrs-listen was bound with --split-verify off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from publisher.cli import config
from publisher.cli import main
from publisher.core.durations import format_duration
from tests.gateways import free_port, taken_port

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`ome-publisher run` in a process of its own (gRPC writes to the process's stderr, not
    Python's), on an empty directory of maps, logging only warnings and errors."""
    maps = tmp_path / "maps"
    maps.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "publisher.cli", "run", "--source", f"dir:{maps}", "--listen", f"127.0.0.1:{free_port()}",
               "--log-level", "warning", *args]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("server", ["xds", "lrs"])
def test_a_taken_grpc_address_is_our_one_line_and_nothing_else(tmp_path: Path, server: str) -> None:
    with taken_port() as port:
        mode = ["--envoy-xds-listen", f"127.0.0.1:{port}"] if server == "xds" else [
            "--envoy-dir", str(tmp_path), "--envoy-lrs-listen", f"127.0.0.1:{port}"]  # fmt: skip
        finished = _run(["--adapter", "envoy", *mode], tmp_path)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == f"ome-publisher run: --envoy-{server}-listen: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_port_left_in_time_wait_is_not_taken(tmp_path: Path) -> None:
    """The check before gRPC binds as gRPC does (SO_REUSEADDR): a port whose last connection is in
    TIME_WAIT (a restarted sidecar's Envoys) is free, not "in use"."""
    import socket

    from adapters.listen import bind_problem

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    assert bind_problem(f"127.0.0.1:{port}") is None


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("ome-publisher run: "), line
    return line.removeprefix("ome-publisher run: ")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--status-delay", "-1s"], "--status-delay: '-1s' is negative: it must be 0 or longer"),
        (["--status-delay=-1s"], "--status-delay: '-1s' is negative: it must be 0 or longer"),
        (["--resync", "-5m"], "--resync: '-5m' is negative: it must be longer than zero"),
        (["--label-selector", "-bad=x"], "--label-selector: '-bad=x' is not a label selector"),
    ],
    ids=["space", "equals", "positive-duration", "selector"],
)
def test_a_value_starting_with_a_dash_is_the_options_value(capsys, tmp_path, argv: list[str], expected: str) -> None:
    line = refused(capsys, ["run", *argv, "--once", "--json-path", str(tmp_path / "out.json")])
    assert line.startswith(expected), line


def test_an_option_after_an_option_wanting_a_value_is_still_an_option(capsys) -> None:
    # `--status-delay --once`: the value is missing; argparse's own word for that stays.
    assert main(["run", "--status-delay", "--once"]) == 2
    assert "expected one argument" in capsys.readouterr().err


def _ranges() -> dict[str, object]:
    return {name: config.duration_range(info) for name, info in config.RunConfig.model_fields.items() if config.duration_range(info)}


def test_every_duration_option_has_a_ceiling() -> None:
    ranges = _ranges()
    assert {"timeout", "resync", "status_delay", "split_interval", "probe_max_age", "source_stale_after",
            "nginx_min_reload_interval", "route_status_timeout"} <= set(ranges)  # fmt: skip
    chosen = {name: (r.least, r.most) for name, r in ranges.items()}  # type: ignore[attr-defined]
    assert chosen["status_delay"] == (0.0, 3600.0) and chosen["split_interval"] == (10.0, 3600.0)
    assert chosen["probe_max_age"] == (0.0, 7 * 86400.0) and chosen["resync"] == (0.0, 86400.0)


@pytest.mark.parametrize("name", sorted(_ranges()))
def test_each_duration_is_refused_just_past_its_ceiling_and_taken_at_it(name: str) -> None:
    bound = _ranges()[name]
    most = bound.most  # type: ignore[attr-defined]
    assert bound(format_duration(most)) == most  # type: ignore[operator]
    with pytest.raises(ValueError, match="is longer than"):
        bound(format_duration(most) + "1ms")  # type: ignore[operator]


def test_a_status_delay_of_a_hundred_million_hours_is_refused(capsys, tmp_path) -> None:
    line = refused(capsys, ["run", "--status-delay", "100000000h", "--once", "--json-path", str(tmp_path / "out.json")])
    assert line == "--status-delay: '100000000h' is longer than 1h, the longest this option takes", line


def test_the_once_timeout_says_what_it_waited_for_once(tmp_path: Path) -> None:
    finished = _run(["--adapter", "envoy", "--envoy-xds-listen", f"127.0.0.1:{free_port()}", "--once", "--timeout", "1s"], tmp_path)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == "ome-publisher run: no result within 1s, waiting for the gateway's read-back (no Envoy connected)\n"


def test_load_reports_with_the_split_check_off_are_refused_and_nothing_is_bound(capsys, tmp_path) -> None:
    with taken_port() as port:  # were it bound, this would say "Address already in use"
        line = refused(capsys, ["run", "--source", f"dir:{tmp_path}", "--adapter", "envoy", "--envoy-dir", str(tmp_path),
                                "--envoy-lrs-listen", f"127.0.0.1:{port}", "--split-verify", "off", "--once", "--timeout", "5s"])  # fmt: skip
    assert line.startswith("--envoy-lrs-listen serves only the split check, which --split-verify off turns off: drop one"), line
