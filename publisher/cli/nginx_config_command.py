"""`ome-publisher nginx-config`: the NGINX http {} snippet that serves what the nginx adapter pushes
in Lua mode."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from publisher.cli.command import EXIT_INPUT, EXIT_OK
from publisher.core.durations import DURATION_UNITS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Prints the text to include inside http {}: the Lua modules shipped with this package, the "
        "routing table, the catch-all server on --listen and the control listener `run --adapter nginx "
        "--nginx-mode lua` pushes to. The main nginx.conf must load ndk_http_module and ngx_http_lua_module "
        "(see --load-modules); Debian's libnginx-mod-http-lua, lua-resty-core and lua-cjson provide them."
    )
    parser.add_argument("--listen", required=True, metavar="ADDR", help="where published hostnames are served (PORT or HOST:PORT)")
    parser.add_argument("--control-listen", required=True, metavar="HOST:PORT", help="the control listener; keep it on 127.0.0.1")
    parser.add_argument("--secret-file", required=True, metavar="PATH", help="the shared secret, the same file as --nginx-secret-file")
    parser.add_argument("--shared-dict-size", default="32m", metavar="SIZE", help="routing table size, ~600 B per map (default: 32m)")
    parser.add_argument(
        "--counts-dict-size",
        default="8m",
        metavar="SIZE",
        help="request counters per map backend for the served-split check, ~131 B each (default: 8m; `off`: no counting)",
    )
    parser.add_argument("--ca-file", metavar="PATH", help="CA bundle for https backends (default: the system bundle)")
    parser.add_argument(
        "--route-idle-timeout",
        type=_route_idle_timeout,
        default="1h",
        metavar="DURATION",
        help="the longest a request may go without a byte from or to its backend, the wait for the first one included; "
        f"no total deadline (`run --route-idle-timeout` in reload mode; {DURATION_UNITS}; default: 1h)",
    )
    parser.add_argument("--lua-dir", metavar="DIR", help="copy the Lua modules into DIR (made if missing) and load them from there, "
                        "for an NGINX that does not see this package's files (default: load them from the package)")
    parser.add_argument("--load-modules", action="store_true", help="print the load_module lines for the main nginx.conf instead")
    parser.set_defaults(run=_nginx_config)


def _route_idle_timeout(value: str) -> float:
    from adapters.timeouts import idle_timeout_seconds

    try:
        return idle_timeout_seconds(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _nginx_config(args: argparse.Namespace) -> int:
    from adapters.nginx.lua_snippet import LOAD_MODULES, LUA_DIR, copy_lua_modules, http_snippet, secret_problem

    if args.load_modules:
        print("".join(f"load_module {module};\n" for module in LOAD_MODULES), end="")
        return EXIT_OK
    # NGINX reads the secret only when it starts: a snippet it would refuse is refused here.
    problem = secret_problem(Path(args.secret_file))
    if problem is not None:
        print(f"ome-publisher nginx-config: --secret-file {args.secret_file}: {problem}", file=sys.stderr)
        return EXIT_INPUT
    lua_dir = Path(args.lua_dir).absolute() if args.lua_dir else LUA_DIR
    try:
        snippet = http_snippet(
            listen=args.listen,
            control_listen=args.control_listen,
            secret_file=Path(args.secret_file),
            shared_dict_size=args.shared_dict_size,
            counts_dict_size=None if args.counts_dict_size == "off" else args.counts_dict_size,
            ca_file=Path(args.ca_file) if args.ca_file else None,
            lua_dir=lua_dir,
            idle_timeout=args.route_idle_timeout,
        )
    except ValueError as exc:
        print(f"ome-publisher nginx-config: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if args.lua_dir:
        try:
            copy_lua_modules(lua_dir)
        except OSError as exc:
            print(f"ome-publisher nginx-config: --lua-dir {lua_dir}: {exc.strerror}", file=sys.stderr)
            return EXIT_INPUT
    print(snippet, end="")
    return EXIT_OK
