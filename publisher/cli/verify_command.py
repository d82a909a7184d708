"""`ome-publisher verify`: each TrafficMap in files, or on a cluster as the sidecar decides it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from adapters.base import publication_problem
from publisher import logs
from publisher.cli.command import EXIT_HELD, EXIT_INPUT, EXIT_OK, OUTPUTS, InputError, duration_argument, print_document, table_cell
from publisher.core.gate import GateOptions, PublishedGate, decide
from publisher.core.durations import DURATION_UNITS
from publisher.core.model import (
    INFERENCE_SERVICE_KIND,
    TRAFFIC_MAP_KIND,
    InferenceService,
    InvalidObject,
    TrafficMap,
    describe_validation_error,
    object_key,
    parse_traffic_map,
    validate,
)
from publisher.core.values import Held, MapKey, Reason
from publisher.core.plan import DEFAULT_HOST_TEMPLATE, publication_for
from publisher.core.verify import compare
from publisher.source.manifests import ManifestError, parse_manifests, read_manifests

STDIN = "-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--timeout", type=duration_argument, default=30.0, metavar="DURATION",
                        help=f"with --kubeconfig: give up reading the cluster after this ({DURATION_UNITS}; default: 30s)")
    parser.add_argument("items", nargs="*", metavar="PATH|NAME",
                        help="a manifest file, or - for stdin; with --kubeconfig, a TrafficMap name (default: every map)")
    parser.set_defaults(run=_verify, usage=parser.format_usage)


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


def _verify(args: argparse.Namespace) -> int:
    if not args.items and not args.kubeconfig:
        print(args.usage() + "ome-publisher verify: give a PATH (- for stdin), or --kubeconfig to read a cluster", file=sys.stderr)
        return EXIT_INPUT
    try:
        reports = _cluster_reports(args) if args.kubeconfig else _file_reports(args)
    except (ManifestError, InputError) as exc:
        print(f"ome-publisher verify: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if args.output == "text":
        print("\n\n".join(_text(report) for report in reports))
    else:
        print_document({"maps": [report.to_json() for report in reports]}, args.output)
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
    from publisher.source.refusals import SourceRefused

    try:
        run_config = config.RunConfig(
            kubeconfig=args.kubeconfig,
            namespace=tuple(args.namespace),
            ome_published_gate=args.ome_published_gate,
            host_template=args.host_template,
        )
    except ValidationError as exc:
        raise InputError(describe_validation_error(exc)) from exc
    logs.configure("text", "warning")  # why a read is slow (watch restarts) shows as it happens
    # The verdicts below say what the loop's "map held" warnings would, once per map.
    logging.getLogger("publisher.loop").setLevel(logging.ERROR)
    names = frozenset(args.items)
    try:
        verdicts = asyncio.run(app.verify_cluster(run_config, names, timeout=args.timeout))
    except (config.ConfigError, KubeError, SourceRefused) as exc:
        raise InputError(str(exc)) from exc
    missing = sorted(names - {verdict.item.key.name for verdict in verdicts})
    if missing:
        where = ", ".join(args.namespace) if args.namespace else "any namespace"
        raise InputError(f"no {TRAFFIC_MAP_KIND} {', '.join(missing)} in {where}")
    if not verdicts:
        raise InputError(f"no {TRAFFIC_MAP_KIND} on the cluster")
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
                raise InputError(f"{name}: object {number} ({kind}) has no metadata.name")
            if kind == TRAFFIC_MAP_KIND:
                maps.append(parse_traffic_map(raw))
                continue
            try:
                isvc = validate(InferenceService, raw)
            except ValidationError as exc:
                raise InputError(
                    f"{name}: InferenceService {object_key(raw)}: {describe_validation_error(exc)}"
                ) from exc
            isvcs[isvc.key] = isvc
    if not maps:
        raise InputError(f"no {TRAFFIC_MAP_KIND} in {', '.join(paths)}")
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
            table_cell(row.allocated),
            table_cell(row.ready),
            table_cell(row.factor),
            table_cell(row.weight),
            table_cell(row.expected),
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


def _healthy_cell(row: _Row) -> str:
    if row.healthy is None:
        return "-"
    shown = "true" if row.healthy else "false"
    if row.expected_healthy is not None and row.expected_healthy != row.healthy:
        shown += f" (recomputed {'true' if row.expected_healthy else 'false'})"
    return shown
