"""NGINX Lua mode's `http {}` snippet (adapters.nginx.lua_snippet.http_snippet), byte for byte.

The expected texts in nginx_lua_snippets/ are what the snippet was when it was an f-string in
adapters/nginx/lua.py, for option sets that take every branch (counts dict or none, default or
given CA file, Lua directory, sizes, listen forms, idle timeouts in s, ms and m). A deliberate
change of the snippet rewrites them: `OME_WRITE_SNIPPETS=1 pytest tests/adapters/test_nginx_lua_snippet.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from adapters.nginx.lua_snippet import LUA_DIR, http_snippet

EXPECTED = Path(__file__).with_name("nginx_lua_snippets")

CASES: dict[str, dict[str, Any]] = {
    "defaults": {"listen": "8080", "control_listen": "127.0.0.1:8082", "secret_file": Path("/run/ome/secret")},
    "no-counts-own-ca": {
        "listen": "0.0.0.0:80",
        "control_listen": "127.0.0.1:9000",
        "secret_file": Path("/etc/ome/secret"),
        "shared_dict_size": "64m",
        "counts_dict_size": None,
        "ca_file": Path("/etc/ome/ca.pem"),
        "lua_dir": Path("/etc/nginx/ome-lua/modules"),
        "idle_timeout": 90.0,
    },
    "small-dicts-short-timeout": {
        "listen": "[::]:8443",
        "control_listen": "[::1]:8082",
        "secret_file": Path("/run/secrets/ome_secret"),
        "shared_dict_size": "32k",
        "counts_dict_size": "1024m",
        "lua_dir": Path("/opt/ome+lua/lua_modules"),
        "idle_timeout": 0.25,
    },
    "long-timeout": {
        "listen": "127.0.0.1:18080",
        "control_listen": "127.0.0.1:18082",
        "secret_file": Path("secret"),
        "counts_dict_size": "16m",
        "idle_timeout": 600.0,
    },
}


def _rendered(options: dict[str, Any]) -> str:
    # The package's own Lua directory depends on where it is installed: named by a placeholder.
    return http_snippet(**options).replace(str(LUA_DIR), "@LUA_DIR@")


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_snippet_is_byte_identical_to_the_expected_text(case):
    expected = EXPECTED / f"{case}.conf"
    if os.environ.get("OME_WRITE_SNIPPETS") == "1":
        expected.write_text(_rendered(CASES[case]))
    assert _rendered(CASES[case]) == expected.read_text()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"listen": "8080;"}, "is not an NGINX listen address"),
        ({"control_listen": "x y"}, "is not an NGINX listen address"),
        ({"shared_dict_size": "8k"}, "is not an NGINX size"),
        ({"counts_dict_size": "1g"}, "is not an NGINX size"),
        ({"idle_timeout": 0.0}, "is not between 1ms and 24h"),
        ({"idle_timeout": 86401.0}, "is not between 1ms and 24h"),
        ({"secret_file": Path("/run/ome/se cret")}, "only letters, digits"),
        ({"ca_file": Path("/etc/ca;.pem")}, "only letters, digits"),
        ({"lua_dir": Path('/opt/"lua')}, "only letters, digits"),
    ],
)
def test_a_value_nginx_would_read_as_syntax_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        http_snippet(**{**CASES["defaults"], **changes})
