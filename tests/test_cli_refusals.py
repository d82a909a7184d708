"""Issue 23, point 10: start-up refuses what cannot work, in one line with exit 2, before anything
is written: combinations the README rules out, an output the sidecar cannot write, and a control
secret NGINX would refuse (shorter than 16 characters, or missing), in `run` and `nginx-config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from publisher.cli import main
from tests.gateways import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "trafficmaps"
SOURCE = ["--source", f"dir:{EXAMPLES}"]
# sysfs: no file can be made there, by root either (a chmod 0555 directory stops no root).
UNWRITABLE = Path("/sys")


def refused(capsys, argv: list[str], command: str = "run") -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ome-publisher {command}: "), captured.err
    assert captured.out == ""
    return lines[0].removeprefix(f"ome-publisher {command}: ")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [([], "--once cannot be combined with --leader-elect"), (["--status-mode", "off"], "--leader-elect needs --source kube")],
    ids=["status", "no-status"],
)
def test_once_with_leader_election_exits_2_and_publishes_nothing(capsys, tmp_path, extra, expected):
    # The directory source: it used to publish and exit 0.
    out = tmp_path / "out.json"
    line = refused(capsys, ["run", *SOURCE, "--json-path", str(out), "--once", "--leader-elect", *extra])
    assert line.startswith(expected), line
    assert not out.exists()


def sidecar_refused(args: list[str]) -> str:
    """`run` as the long-running sidecar, in a process of its own: what it printed on refusing to
    start (a sidecar that starts instead is stopped by the timeout, and the test fails)."""
    sidecar = subprocess.run([sys.executable, "-m", "publisher.cli", "run", "--listen", f"127.0.0.1:{free_port()}", *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    assert sidecar.returncode == 2, sidecar.stderr
    lines = sidecar.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ome-publisher run: "), sidecar.stderr
    return lines[0].removeprefix("ome-publisher run: ")


def test_leader_election_needs_the_kube_source(tmp_path):
    line = sidecar_refused([*SOURCE, "--json-path", str(tmp_path / "out.json"), "--leader-elect"])
    assert line.startswith("--leader-elect needs --source kube"), line


@pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="no /sys")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--json-dir", str(UNWRITABLE)], f"--json-dir {UNWRITABLE}: cannot write there: "),
        (["--json-path", str(UNWRITABLE / "out.json")], f"--json-path {UNWRITABLE / 'out.json'}: cannot write in {UNWRITABLE}: "),
        (["--adapter", "envoy", "--envoy-dir", str(UNWRITABLE)], f"--envoy-dir {UNWRITABLE}: cannot write there: "),
        (["--adapter", "nginx", "--nginx-conf-file", str(UNWRITABLE / "ome.conf"), "--nginx-pid-file", "/run/nginx.pid"],
         f"--nginx-conf-file {UNWRITABLE / 'ome.conf'}: cannot write in {UNWRITABLE}: "),
    ],
    ids=["json-dir", "json-path", "envoy-dir", "nginx-conf-file"],
)
def test_an_output_that_cannot_be_written_exits_2(capsys, args, expected):
    line = refused(capsys, ["run", *SOURCE, "--once", *args])
    assert line.startswith(expected), line
    # The sidecar too: it used to start, serve /readyz 503 and retry forever.
    assert sidecar_refused([*SOURCE, *args]) == line


def write_secret(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("secret", "expected"),
    [
        ("short\n", "holds 5 characters; NGINX needs at least 16"),
        ("  fifteen-chars!!  \n", "holds 15 characters; NGINX needs at least 16"),
        (None, "no such file"),
    ],
    ids=["5", "15-padded", "missing"],
)
def test_a_secret_nginx_would_refuse_stops_run_and_nginx_config(capsys, tmp_path, secret, expected):
    path = write_secret(tmp_path, secret) if secret is not None else tmp_path / "missing"
    line = refused(capsys, ["run", *SOURCE, "--once", "--adapter", "nginx", "--nginx-secret-file", str(path)])
    assert line == f"--nginx-secret-file {path}: {expected}"
    line = refused(capsys, ["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(path)],
                   command="nginx-config")
    assert line == f"--secret-file {path}: {expected}"


def test_a_secret_of_16_characters_is_taken(capsys, tmp_path):
    path = write_secret(tmp_path, "0123456789abcdef\n")
    assert main(["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(path)]) == 0
    assert f'init("{path}")' in capsys.readouterr().out
