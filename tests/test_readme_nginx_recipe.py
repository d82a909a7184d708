"""The README's NGINX recipe, run as written: its commands are read from README.md, only the
absolute paths are moved under a temporary directory and a directory source is added, so NGINX
and the sidecar come up on their default ports (8080 and 9180) side by side and serve a map."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.builders import CHAT_HOST, make_entry, make_isvc, make_map
from tests.gateways import BACKEND_HEADER, Backends, eventually

ROOT = Path(__file__).resolve().parent.parent


def recipe() -> tuple[str, str]:
    """(the shell lines up to and including the `nginx` start, the `ome-publisher run` line)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**Reload mode**"):readme.index("## Operating it")]
    block = "\n".join(line for line in section.splitlines() if line.startswith("    ") or not line.strip())
    lines = textwrap.dedent(block).strip().replace("\\\n", " ").splitlines()
    run = next(i for i, line in enumerate(lines) if line.startswith("ome-publisher run"))
    return "\n".join(lines[:run]) + "\n", lines[run]


def moved(text: str, root: Path) -> str:
    return re.sub(r"(?<![\w.])/(etc|run)/", lambda m: f"{root}/{m.group(1)}/", text)


async def answer(url: str, **headers: str) -> tuple[int, str | None]:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            async with session.get(url, headers=headers) as response:
                return response.status, response.headers.get(BACKEND_HEADER)
    except aiohttp.ClientError:
        return 0, None


@pytest.mark.slow
async def test_the_nginx_recipe_runs_as_written_on_the_default_ports(tmp_path):
    setup, run_line = recipe()
    (tmp_path / "run").mkdir()
    maps = tmp_path / "maps"
    maps.mkdir()
    async with Backends(("worker-a", "worker-b")) as backends:
        entries = [
            make_entry("worker-a", allocated=4, ready=4, weight=2, endpoint=backends.endpoint("worker-a")),
            make_entry("worker-b", allocated=2, ready=2, factor="3", weight=3, endpoint=backends.endpoint("worker-b")),
        ]
        (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map(entries=entries)]))
        # NGINX goes to the background as the recipe starts it: its output goes to a file, not a
        # pipe that the daemon would hold open.
        with (tmp_path / "setup.log").open("wb") as log:
            setup_shell = await asyncio.create_subprocess_exec(
                "bash", "-euc", moved(setup, tmp_path), stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
            assert await asyncio.wait_for(setup_shell.wait(), 30) == 0, (tmp_path / "setup.log").read_text()
        nginx_pid = int((tmp_path / "run" / "nginx-ome.pid").read_text())
        argv = shlex.split(moved(run_line, tmp_path))
        assert argv[:2] == ["ome-publisher", "run"] and "--listen" not in argv
        sidecar = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "publisher.cli", *argv[1:], "--source", f"dir:{maps}", cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await eventually(lambda: _is(answer("http://127.0.0.1:9180/readyz"), 200), timeout=30)
            assert sidecar.returncode is None
            await eventually(lambda: _served(answer("http://127.0.0.1:8080/", Host=CHAT_HOST)), timeout=30)
        finally:
            if sidecar.returncode is None:
                sidecar.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(sidecar.wait(), 10)
                except TimeoutError:
                    sidecar.kill()
                    await sidecar.wait()
            with contextlib.suppress(ProcessLookupError):
                os.kill(nginx_pid, signal.SIGQUIT)
            await eventually(lambda: not _alive(nginx_pid), timeout=10)
    assert sidecar.returncode == 0


async def _is(awaitable, status: int) -> bool:  # type: ignore[no-untyped-def]
    return (await awaitable)[0] == status


async def _served(awaitable) -> bool:  # type: ignore[no-untyped-def]
    status, backend = await awaitable
    return status == 200 and backend in ("worker-a", "worker-b")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
