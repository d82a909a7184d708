"""What every subcommand shares: the exit codes, the output formats, printing a document, the
error of an input that cannot be read, and the duration argument."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from publisher.core.durations import parse_duration

EXIT_OK, EXIT_HELD, EXIT_INPUT = 0, 1, 2


OUTPUTS = ("text", "json", "yaml")


def print_document(document: dict[str, Any], output: str) -> None:
    """`document` as indented JSON or as YAML (key order kept)."""
    if output == "yaml":
        print(yaml.safe_dump(document, sort_keys=False), end="")
    else:
        print(json.dumps(document, indent=2))


def duration_argument(value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class InputError(Exception):
    """An input that cannot be read or parsed; the message names it."""


def table_cell(value: int | str | None) -> str:
    return "-" if value is None else str(value)
