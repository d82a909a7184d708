"""`ome-publisher envoy-bootstrap`: an Envoy bootstrap that serves what the envoy adapter publishes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from publisher.cli.command import EXIT_INPUT, EXIT_OK
from publisher.core.addresses import split_host_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Prints (YAML) an Envoy bootstrap whose listener serves what `run --adapter envoy` "
        "publishes: with --xds, from the sidecar's delta ADS server (`--envoy-xds-listen`); with "
        "--envoy-dir, from DIR/rds.yaml and DIR/cds.yaml. Envoy reports its requests per map backend "
        "for the served-split check to the xDS server, or in file mode to --lrs."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--xds", metavar="HOST:PORT", help="the sidecar's xDS server, as given to --envoy-xds-listen")
    source.add_argument("--envoy-dir", metavar="DIR", help="the directory the envoy adapter writes (file mode)")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="address of the traffic listener")
    parser.add_argument("--admin", metavar="HOST:PORT", help="address of Envoy's admin interface (default: none)")
    parser.add_argument("--envoy-route-config", default="ome-global", metavar="NAME", help="file mode: route configuration name (default: ome-global)")
    parser.add_argument(
        "--lrs",
        metavar="HOST:PORT",
        help="file mode: the sidecar's Load Reporting Service, as given to `run --envoy-lrs-listen` (default: none, Envoy reports no load)",
    )
    parser.add_argument(
        "--backend-stats",
        action="store_true",
        help="xDS mode: keep each map backend's upstream_* stats (Envoy keeps no per-map cluster stats by default: "
        "at 10,000 maps they make its first load about 2.5 s slower)",
    )
    tls = parser.add_argument_group(
        "mutual TLS to the publisher (all three or none; `run --envoy-xds-tls-cert/--envoy-xds-tls-key/--envoy-xds-client-ca`)"
    )
    tls.add_argument("--tls-cert", metavar="FILE", help="Envoy's client certificate (PEM), signed by the publisher's --envoy-xds-client-ca")
    tls.add_argument("--tls-key", metavar="FILE", help="its private key (PEM)")
    tls.add_argument("--tls-ca", metavar="FILE", help="the CA that signed the publisher's certificate (PEM)")
    tls.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the publisher's certificate must carry as a subject alternative name, sent as SNI "
        "(an IP address: an IP SAN; default: the host of --xds, or of --lrs)",
    )
    parser.add_argument(
        "--no-load-stats",
        dest="load_stats",
        action="store_false",
        help="leave out the Load Reporting Service (xDS mode's, or file mode's --lrs), through which Envoy reports its "
        "requests per map backend to the sidecar for the served-split check (`run --split-verify`)",
    )
    parser.set_defaults(run=_envoy_bootstrap)


def _envoy_bootstrap(args: argparse.Namespace) -> int:
    from adapters.envoy.bootstrap import ClientTls, bootstrap, xds_bootstrap

    try:
        listen_host, listen_port = split_host_port(args.listen)
        admin = split_host_port(args.admin) if args.admin else (None, None)
        xds = split_host_port(args.xds) if args.xds else None
        lrs = split_host_port(args.lrs) if args.lrs else None
    except ValueError as exc:
        print(f"ome-publisher envoy-bootstrap: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if args.backend_stats and xds is None:
        # File mode keeps every stat already: the flag would change nothing.
        print("ome-publisher envoy-bootstrap: --backend-stats is for --xds (with --envoy-dir Envoy keeps every stat)", file=sys.stderr)
        return EXIT_INPUT
    if lrs is not None and xds is not None:
        print("ome-publisher envoy-bootstrap: --lrs is for --envoy-dir (with --xds Envoy reports load to the xDS server)", file=sys.stderr)
        return EXIT_INPUT
    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        print("ome-publisher envoy-bootstrap: give all three of --tls-cert, --tls-key and --tls-ca, or none", file=sys.stderr)
        return EXIT_INPUT
    server = xds or lrs
    if (all(tls_files) or args.tls_server_name) and server is None:
        print("ome-publisher envoy-bootstrap: --tls-* are for --xds or --lrs", file=sys.stderr)
        return EXIT_INPUT
    if args.tls_server_name and not all(tls_files):
        print("ome-publisher envoy-bootstrap: --tls-server-name needs --tls-cert, --tls-key and --tls-ca", file=sys.stderr)
        return EXIT_INPUT
    tls = ClientTls(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca), args.tls_server_name or server[0]) if server and all(tls_files) else None
    if xds is not None:
        text = xds_bootstrap(
            xds_host=xds[0],
            xds_port=xds[1],
            listen_host=listen_host,
            listen_port=listen_port,
            admin_host=admin[0],
            admin_port=admin[1],
            backend_stats=args.backend_stats,
            load_stats=args.load_stats,
            tls=tls,
        )
    else:
        text = bootstrap(
            envoy_dir=Path(args.envoy_dir),
            listen_host=listen_host,
            listen_port=listen_port,
            admin_host=admin[0],
            admin_port=admin[1],
            route_config=args.envoy_route_config,
            lrs=lrs if args.load_stats else None,
            tls=tls,
        )
    print(text, end="")
    return EXIT_OK
