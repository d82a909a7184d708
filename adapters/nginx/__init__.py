"""The NGINX OSS adapter: its options and `build`, for the registry (adapters.ADAPTERS).

- options.py: NginxOptions, both modes'.
- reload_render.py: reload mode's renderer (pure): each map's part, the whole file and its read-back.
- reload.py: reload mode's transport, which owns that one included file and reloads NGINX.
- lua_render.py: Lua mode's renderer (pure): each map's entry in NGINX's Lua table, its checksum.
- lua_snippet.py: the `http {}` snippet `ome-publisher nginx-config` writes, from templates/, which
  loads the Lua of lua_modules/.
- lua.py: Lua mode's transport, which pushes weights into the running NGINX and confirms them,
  with its control listener's client; its bookkeeping is pure: lua_table.py (the confirmed table,
  its batches and checksums, what a restart or a broken table gets) and lua_names.py (the cache of
  resolved endpoint names).
- counts.py: Lua mode's request counts for the split check, read through that transport.
"""

from __future__ import annotations

from typing import Any

from adapters.nginx.lua import build as build_lua
from adapters.nginx.options import VERSION_PATH, NginxOptions
from adapters.nginx.reload import build_reload

__all__ = ["VERSION_PATH", "NginxOptions", "build"]


def build(options: NginxOptions) -> tuple[Any, Any]:
    """The renderer and transport for options.nginx_mode."""
    if options.nginx_mode == "lua":
        return build_lua(options)
    return build_reload(options)
