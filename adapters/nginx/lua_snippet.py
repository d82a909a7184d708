"""NGINX Lua mode's `http {}` snippet, which `ome-publisher nginx-config` writes: filled in from
adapters/nginx/templates/ome-lua.conf, loading the Lua modules of adapters/nginx/lua_modules/ (or a
copy of them where NGINX sees them); and the check of the control secret both sides read."""

from __future__ import annotations

import functools
import re
import shutil
import string
from pathlib import Path

from adapters.listen import check_nginx_listen
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, MAX_ROUTE_TIMEOUT, unit_duration

LUA_DIR = Path(__file__).with_name("lua_modules")
# The modules Debian's libnginx-mod-http-lua installs; load_module belongs in the main nginx.conf,
# outside http {} (Debian's package already adds them under /etc/nginx/modules-enabled/).
LOAD_MODULES = ("modules/ndk_http_module.so", "modules/ngx_http_lua_module.so")
DEFAULT_CA_FILE = Path("/etc/ssl/certs/ca-certificates.crt")
# The snippet `http_snippet` fills in, beside the Lua modules (package data). Its placeholders are
# @{name}: NGINX's own variables are $name, string.Template's default delimiter.
SNIPPET_TEMPLATE = Path(__file__).with_name("templates") / "ome-lua.conf"
# Mirrors ome_control.lua's init, which stops NGINX on a shorter secret (whitespace around it left out).
SECRET_MIN_LENGTH = 16
# A lua_shared_dict size (--shared-dict-size, --counts-dict-size): NGINX's spelling in k or m, no
# leading zero, from 32k (NGINX refuses 1k and cannot allocate an 8k dict) to 1024m. The chart's
# values schema has this very pattern (tests/test_chart_limits.py).
SIZE_PATTERN = r"^((3[2-9]|[4-9][0-9]|[1-9][0-9]{2,5})k|([1-9][0-9]{0,2}|10[01][0-9]|102[0-4])m)$"
_SIZE = re.compile(SIZE_PATTERN)
# The characters a path in the snippet may have: nothing NGINX could read as syntax.
PATH_PATTERN = r"^[A-Za-z0-9_./+-]+$"


def secret_problem(path: Path) -> str | None:
    """Why NGINX would refuse the control secret in `path` at its start (missing, unreadable, or
    shorter than SECRET_MIN_LENGTH once stripped as ome_control.lua strips it), or None."""
    try:
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if len(secret) < SECRET_MIN_LENGTH:
        return f"holds {len(secret)} characters; NGINX needs at least {SECRET_MIN_LENGTH}"
    return None


def copy_lua_modules(directory: Path) -> None:
    """This package's Lua modules copied into `directory` (made if missing), for an NGINX that does
    not see this package's files, e.g. in another container of the pod."""
    directory.mkdir(parents=True, exist_ok=True)
    if directory.resolve() == LUA_DIR.resolve():
        return  # already there
    for module in sorted(LUA_DIR.glob("*.lua")):
        shutil.copyfile(module, directory / module.name)


class _SnippetTemplate(string.Template):
    delimiter = "@"


@functools.cache
def _snippet_template() -> _SnippetTemplate:
    return _SnippetTemplate(SNIPPET_TEMPLATE.read_text(encoding="utf-8"))


def http_snippet(
    *,
    listen: str,
    control_listen: str,
    secret_file: Path,
    shared_dict_size: str = "32m",
    counts_dict_size: str | None = "8m",
    ca_file: Path | None = None,
    lua_dir: Path = LUA_DIR,
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT,
) -> str:
    """The text to include inside `http {}`: the table, the catch-all server, the two upstreams
    and the control listener, with the Lua modules from `lua_dir` (this package's, or a copy where
    NGINX sees it: `copy_lua_modules`). `idle_timeout` (adapters.timeouts) bounds the wait between
    two reads or writes of a backend; there is no total deadline. Raises ValueError on a value
    NGINX would read as syntax."""
    check_nginx_listen(listen)
    check_nginx_listen(control_listen)
    for size in (shared_dict_size, counts_dict_size):
        if size is not None and not _SIZE.fullmatch(size):
            raise ValueError(f"{size!r} is not an NGINX size from 32k to 1024m, such as 32m")
    if not 0 < idle_timeout <= MAX_ROUTE_TIMEOUT:
        raise ValueError(f"idle timeout {idle_timeout:g}s is not between 1ms and 24h")
    ca_file = ca_file or DEFAULT_CA_FILE
    counts_dict = (
        ""
        if counts_dict_size is None
        else "# Request counts per map backend for the served-split check: about 131 bytes each (8m: ~60,000\n"
        f"# backends); a full dict evicts the oldest counter, which the sidecar reads as a restart.\nlua_shared_dict ome_counts {counts_dict_size};\n"
    )
    for path in (secret_file, ca_file, lua_dir):
        if not re.fullmatch(PATH_PATTERN, str(path)):
            raise ValueError(f"{str(path)!r}: only letters, digits and _./+- are allowed in a path here")
    return _snippet_template().substitute(
        load_modules="".join(f"#   load_module {module};\n" for module in LOAD_MODULES),
        lua_dir=lua_dir,
        shared_dict_size=shared_dict_size,
        counts_dict=counts_dict,
        secret_file=secret_file,
        listen=listen,
        idle_timeout=unit_duration(idle_timeout),
        ca_file=ca_file,
        control_listen=control_listen,
    )
