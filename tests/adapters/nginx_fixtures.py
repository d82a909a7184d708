"""Builders and a running NGINX for tests/adapters/test_nginx.py and test_nginx_lua.py.

`running_nginx(directory)` starts Debian's NGINX as a child on 127.0.0.1 free ports, with every
path it writes inside `directory`, and stops it by PID (SIGQUIT, then SIGKILL after a bound).
`extra_server` adds a server block of the operator's own to the main nginx.conf ({listen} is filled in).
`running_lua_nginx(directory)` does the same for an NGINX serving `ome-publisher nginx-config`'s
snippet (Lua mode); `restart()` stops it and starts a new master on the same ports; `eval(code)`
runs Lua inside it through a test-only listener, to break its table the ways a fault would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from adapters.nginx import NginxOptions
from adapters.nginx.lua import LuaTransport
from adapters.nginx.lua_render import LuaPart, entry_text
from adapters.nginx.lua_snippet import LOAD_MODULES, LUA_DIR, http_snippet
from adapters.nginx.lua_table import read_table
from adapters.nginx.reload_render import render
from publisher.core.values import Backend, MapKey, Publication, Route
from tests.gateways import eventually, free_port

NGINX = "/usr/sbin/nginx"


def make_pub(name: str = "m", *backends: tuple[str, str, int], **overrides: Any) -> Publication:
    """A valid Publication; `backends` are (cluster, endpoint, weight)."""
    fields: dict[str, Any] = {
        "namespace": "ns",
        "name": name,
        "hostname": f"{name}.example.com",
        "generation": 1,
        "observed_isvc_generation": 1,
        "backends": tuple(Backend(cluster=c, endpoint=e, weight=w) for c, e, w in backends),
    }
    fields.update(overrides)
    return Publication(**fields)


def routes(*pubs: Publication) -> dict[MapKey, Route]:
    return {pub.key: pub.route for pub in pubs}


def confirm_parts(transport: LuaTransport, parts: Mapping[MapKey, LuaPart]) -> None:
    """`transport` as if NGINX had confirmed `parts` (every name at 127.0.0.1), for a test whose
    control listener is a fake."""
    lines = "\n".join(f"{key} {entry_text(part, {b.name: ('127.0.0.1',) for b in part.backends})}" for key, part in parts.items())
    transport._table.adopt("boot-1", 1, read_table(lines))


@dataclass
class RunningNginx:
    directory: Path
    main_conf: Path
    conf_file: Path
    pid_file: Path
    listen_port: int
    status_port: int
    process: asyncio.subprocess.Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}/"

    def options(self, **overrides: Any) -> NginxOptions:
        fields: dict[str, Any] = {
            "nginx_conf_file": self.conf_file,
            "nginx_listen": f"127.0.0.1:{self.listen_port}",
            "nginx_status_listen": f"127.0.0.1:{self.status_port}",
            "nginx_pid_file": self.pid_file,
        }
        fields.update(overrides)
        return NginxOptions(**fields)

    def command(self, *args: str) -> str:
        return " ".join([NGINX, "-p", str(self.directory), "-c", str(self.main_conf), *args])

    def errors(self) -> str:
        path = self.directory / "error.log"
        return path.read_text() if path.exists() else ""


_MAIN_CONF = """\
error_log {dir}/error.log notice;
pid {dir}/nginx.pid;
worker_processes 1;
worker_shutdown_timeout 1s;
events {{
    worker_connections 512;
}}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    server_names_hash_bucket_size 128;
    {extra}
    include {conf};
}}
"""


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGQUIT)
    try:
        await asyncio.wait_for(process.wait(), 5)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def running_nginx(directory: Path, *, extra_server: str = "") -> AsyncIterator[RunningNginx]:
    """NGINX serving an (empty) adapter file; the file is what an adapter's current() reads back."""
    (directory / "tmp").mkdir(parents=True)
    conf_file = directory / "ome-gateway-publisher.conf"
    main_conf = directory / "nginx.conf"
    listen_port, status_port = free_port(), free_port()
    extra = extra_server.replace("{listen}", f"127.0.0.1:{listen_port}")
    main_conf.write_text(_MAIN_CONF.format(dir=directory, conf=conf_file, extra=extra))
    conf_file.write_text(render({}, listen=f"127.0.0.1:{listen_port}", status_listen=f"127.0.0.1:{status_port}"))
    with (directory / "stderr.log").open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            NGINX, "-p", str(directory), "-c", str(main_conf), "-g", "daemon off;",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    nginx = RunningNginx(directory, main_conf, conf_file, directory / "nginx.pid", listen_port, status_port, process)
    try:
        await eventually(lambda: nginx.pid_file.exists() or process.returncode is not None, timeout=10)
        assert process.returncode is None, f"nginx exited: {(directory / 'stderr.log').read_text()}"
        yield nginx
    finally:
        await _stop(process)


# --- Lua mode ------------------------------------------------------------------------------------

_LUA_MAIN_CONF = """\
{load_modules}
error_log {dir}/error.log notice;
pid {dir}/nginx.pid;
worker_processes {workers};
events {{
    worker_connections 512;
}}
http {{
    access_log off;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    include {conf};
    # Test-only: runs the Lua chunk POSTed to it and answers what it returns.
    server {{
        listen 127.0.0.1:{eval_port};
        location / {{
            content_by_lua_block {{
                ngx.req.read_body()
                local chunk = assert(loadstring(ngx.req.get_body_data()))
                ngx.say(require("cjson").encode({{ chunk() }}))
            }}
        }}
    }}
}}
"""


@dataclass
class RunningLuaNginx:
    directory: Path
    main_conf: Path
    secret_file: Path
    listen_port: int
    control_port: int
    eval_port: int
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}/"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def pid_file(self) -> Path:
        return self.directory / "nginx.pid"

    def options(self, **overrides: Any) -> NginxOptions:
        fields: dict[str, Any] = {
            "nginx_mode": "lua",
            "nginx_control_url": self.control_url,
            "nginx_secret_file": self.secret_file,
        }
        fields.update(overrides)
        return NginxOptions(**fields)

    def pids(self) -> tuple[int, frozenset[int]]:
        """(master PID, worker PIDs) as the kernel sees them now."""
        assert self.process is not None
        master = self.process.pid
        children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
        return master, frozenset(int(pid) for pid in children)

    def errors(self) -> str:
        path = self.directory / "error.log"
        return path.read_text() if path.exists() else ""

    async def eval(self, code: str) -> list[Any]:
        """What the Lua chunk `code` returns, run inside a worker (the shared dict is
        ngx.shared.ome_routes)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(f"http://127.0.0.1:{self.eval_port}/", data=code) as response:
                assert response.status == 200, await response.text()
                return json.loads(await response.text())

    def configure(self, *, shared_dict_size: str, counts_dict_size: str | None = "1m", ca_file: Path | None = None,
                  lua_dir: Path = LUA_DIR) -> None:
        """Write the nginx-config snippet, read at the next start."""
        (self.directory / "ome-lua.conf").write_text(
            http_snippet(
                listen=f"127.0.0.1:{self.listen_port}",
                control_listen=f"127.0.0.1:{self.control_port}",
                secret_file=self.secret_file,
                shared_dict_size=shared_dict_size,
                counts_dict_size=counts_dict_size,
                ca_file=ca_file,
                lua_dir=lua_dir,
            )
        )

    async def start(self) -> None:
        with (self.directory / "stderr.log").open("ab") as stderr:
            self.process = await asyncio.create_subprocess_exec(
                NGINX, "-p", str(self.directory), "-c", str(self.main_conf), "-g", "daemon off;",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        process = self.process

        def up() -> bool:
            if process.returncode is not None:
                return True
            try:
                return len(self.pids()[1]) > 0 and self.pid_file.exists()
            except FileNotFoundError:
                return False

        await eventually(up, timeout=10)
        assert process.returncode is None, f"nginx exited: {(self.directory / 'stderr.log').read_text()}"

    async def stop(self) -> None:
        if self.process is not None:
            await _stop(self.process)
            self.pid_file.unlink(missing_ok=True)

    async def restart(self) -> None:
        await self.stop()
        await self.start()


@contextlib.asynccontextmanager
async def running_lua_nginx(
    directory: Path,
    *,
    workers: int = 2,
    shared_dict_size: str = "4m",
    counts_dict_size: str | None = "1m",
    ca_file: Path | None = None,
    lua_dir: Path = LUA_DIR,
    start: bool = True,
) -> AsyncIterator[RunningLuaNginx]:
    """NGINX with the Lua modules, serving the nginx-config snippet with an empty table; with
    `start=False`, configured on its ports but not started (a test starts it later)."""
    (directory / "tmp").mkdir(parents=True, exist_ok=True)
    secret_file = directory / "secret"
    # A secret of its own: a transport whose NGINX stopped must never be let into another test's
    # (or another process's) NGINX that took its port since.
    secret_file.write_text(f"test-secret-{secrets.token_hex(16)}\n")
    listen_port, control_port, eval_port = free_port(), free_port(), free_port()
    snippet = directory / "ome-lua.conf"
    main_conf = directory / "nginx.conf"
    load_modules = "".join(f"load_module /usr/lib/nginx/{module};\n" for module in LOAD_MODULES)
    main_conf.write_text(
        _LUA_MAIN_CONF.format(load_modules=load_modules, dir=directory, workers=workers, conf=snippet, eval_port=eval_port)
    )
    nginx = RunningLuaNginx(directory, main_conf, secret_file, listen_port, control_port, eval_port)
    nginx.configure(shared_dict_size=shared_dict_size, counts_dict_size=counts_dict_size, ca_file=ca_file, lua_dir=lua_dir)
    try:
        if start:
            await nginx.start()
        yield nginx
    finally:
        await nginx.stop()
