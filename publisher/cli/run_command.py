"""`ome-publisher run`: the sidecar, its start-up failures in one line, and what `--once` published."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

from publisher import logs
from publisher.cli.command import EXIT_HELD, EXIT_INPUT, EXIT_OK, print_document

if TYPE_CHECKING:
    from publisher.cli import app


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        print_document(document, run_config.output)
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
    from publisher.source.refusals import SourceRefused

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
