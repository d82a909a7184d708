"""`ome-publisher status`: every region's verdict on each map, waiting for them when asked, and
forgetting a region that is gone."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from publisher.cli.command import EXIT_HELD, EXIT_INPUT, EXIT_OK, OUTPUTS, InputError, duration_argument, print_document, table_cell
from publisher.core.durations import DURATION_UNITS
from publisher.core.model import TRAFFIC_MAP_KIND

if TYPE_CHECKING:
    from publisher.kube import Kube
    from publisher.status import fleet


# How often --wait-published reads the fleet again: two lists a second are nothing to an API server.
WAIT_INTERVAL = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Reads the TrafficMaps (only those NAMEd, when given) and every region's verdicts on them: the "
        "conditions of regions in --status-mode condition and the RegionReports of regions in report mode. "
        "A region is published for a map when it serves the map's current generation. Exit 0 when every "
        "region is published for every map, 1 when any is not, 2 when the cluster cannot be read."
    )
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="text", help="a table, or one JSON or YAML document (default: text)")
    parser.add_argument("--kubeconfig", metavar="KUBECONFIG",
                        help="the control-plane cluster (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="only this namespace; repeat for several (default: all namespaces)")
    parser.add_argument("--region", action="append", default=[], metavar="NAME",
                        help="a region that must be published, even where it has said nothing yet; repeat for several "
                        "(default: every region that reports on any map read)")
    parser.add_argument("--wait-published", action="store_true",
                        help="read again every second until every region is published for every map (a NAMEd map "
                        "that does not exist yet is waited for); exit 1 at --timeout")
    parser.add_argument("--timeout", type=duration_argument, default=None, metavar="DURATION",
                        help=f"with --wait-published: give up after this ({DURATION_UNITS}; default: 5m)")
    parser.add_argument("--forget-region", metavar="NAME",
                        help="instead: remove what a region that is gone left behind (its RegionReports, its "
                        "condition on each map) and exit 0; exit 2 when it left nothing (a mistyped name)")
    parser.add_argument("names", nargs="*", metavar="NAME", help="a TrafficMap name (default: every map)")
    parser.set_defaults(run=_status)


def _status(args: argparse.Namespace) -> int:
    from publisher.kube import KubeError

    try:
        return asyncio.run(_status_async(args))
    except KubeError as exc:
        print(f"ome-publisher status: {exc.message if exc.reason == 'InvalidConfiguration' else f'API server: {exc}'}", file=sys.stderr)
        return EXIT_INPUT
    except InputError as exc:
        print(f"ome-publisher status: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return EXIT_HELD


def _forget_region_problem(args: argparse.Namespace) -> str | None:
    """Why --forget-region cannot run as given, in one line; None when it can."""
    from publisher.core.addresses import is_dns_label

    region = args.forget_region
    if not is_dns_label(region):
        return f"--forget-region: {region!r} is not a region name (a DNS label: lower case letters, digits, '-', at most 63)"
    given = [flag for flag, value in (("NAME", args.names), ("--region", args.region), ("--wait-published", args.wait_published),
                                      ("--timeout", args.timeout is not None), ("--output", args.output != "text")) if value]
    if given:
        return f"--forget-region removes a region's leftovers and reads no map: it takes no {', '.join(given)}"
    return None


async def _forget_region(kube: Kube, region: str, namespaces: tuple[str, ...]) -> int:
    from publisher.status import fleet

    forgotten = await fleet.forget_region(kube, region, namespaces)
    if forgotten.unread is not None:
        print(f"ome-publisher status: {forgotten.unread}", file=sys.stderr)
    if not forgotten.reports and not forgotten.conditions:
        where = ", ".join(namespaces) if namespaces else "any namespace"
        seen = await fleet.regions_seen(kube, namespaces)
        known = f" (regions seen: {', '.join(seen)})" if seen else ""
        raise InputError(f"region {region} left nothing to remove in {where}: no RegionReport, no condition{known}")
    print(f"region {region}: deleted {forgotten.reports} RegionReport(s), removed {forgotten.conditions} condition(s)")
    return EXIT_OK if forgotten.unread is None else EXIT_INPUT


async def _status_async(args: argparse.Namespace) -> int:
    from publisher.cli import config
    from publisher.status import fleet
    from publisher.kube import Kube

    namespaces = tuple(args.namespace)
    names = frozenset(args.names)
    if args.forget_region is not None:
        problem = _forget_region_problem(args)
        if problem is not None:
            raise InputError(problem)
    timeout = 300.0 if args.timeout is None else args.timeout
    kube = await Kube.connect(args.kubeconfig)
    try:
        if args.forget_region is not None:
            return await _forget_region(kube, args.forget_region, namespaces)
        event_loop = asyncio.get_running_loop()
        deadline = event_loop.time() + timeout
        while True:
            view, unread = await fleet.read_fleet(kube, namespaces, names=names, regions=args.region)
            missing = sorted(names - {item.key.name for item in view})
            done = not missing and bool(view) and all(item.published for item in view)
            if done or not args.wait_published or event_loop.time() >= deadline:
                break
            await asyncio.sleep(WAIT_INTERVAL)
    finally:
        await kube.close()
    if missing and not args.wait_published:
        where = ", ".join(namespaces) if namespaces else "any namespace"
        raise InputError(f"no {TRAFFIC_MAP_KIND} {', '.join(missing)} in {where}")
    if not view and not names:
        raise InputError(f"no {TRAFFIC_MAP_KIND} on the cluster")
    if args.output == "text":
        print(_fleet_text(view, missing))
    else:
        print_document({"published": done, "missing": missing, "unread": unread, "maps": [item.to_json() for item in view]}, args.output)
    if unread is not None:
        print(f"ome-publisher status: {unread}", file=sys.stderr)
    if args.wait_published and not done:
        print(f"ome-publisher status: not published everywhere within {config.format_duration(timeout)}", file=sys.stderr)
    return EXIT_OK if done else EXIT_HELD


_FLEET_HEADER = ("REGION", "MODE", "OBSERVED", "STATUS", "REASON", "SINCE")


def _fleet_text(view: Sequence[fleet.MapStatus], missing: Sequence[str]) -> str:
    blocks = []
    for item in view:
        regions = item.verdicts
        behind = [region for region, verdict in regions.items() if verdict is None or not verdict.published(item.generation)]
        if not regions:
            summary = "no region reports on it"
        elif behind:
            summary = f"published in {len(regions) - len(behind)} of {len(regions)} regions; not in {', '.join(behind)}"
        else:
            summary = f"published in all {len(regions)} regions"
        table = [_FLEET_HEADER] + [
            (region, "-", "-", "-", "no verdict", "-") if verdict is None else
            (region, verdict.mode, table_cell(verdict.observed_generation), verdict.status, verdict.reason, verdict.last_transition_time or "-")
            for region, verdict in regions.items()
        ]
        widths = [max(len(line[column]) for line in table) for column in range(len(_FLEET_HEADER))]
        lines = [f"{item.key} generation {item.generation}: {summary}"]
        if regions:
            lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
        blocks.append("\n".join(lines))
    blocks.extend(f"{name}: no such {TRAFFIC_MAP_KIND} yet" for name in missing)
    return "\n\n".join(blocks)
