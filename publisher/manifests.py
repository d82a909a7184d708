"""Kubernetes manifests from text: YAML or JSON, one object, several YAML documents, or a `kind: List`.

`parse_manifests(name, text)` is pure: raw object dicts in input order, or a ManifestError naming
the input (and the line, where the parser knows it). `read_manifests(path)` is the thin file-reading
wrapper. Neither validates objects: that is the model's job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ManifestError", "parse_manifests", "read_manifests"]

_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The safe loader (libyaml's when present: several times faster), with timestamps left as
    strings, as Kubernetes reads them: `lastTransitionTime: 2025-01-01T00:00:00Z` is a string."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


class ManifestError(ValueError):
    """An input that cannot be read or parsed; `str()` names the input and, when known, the line."""

    def __init__(self, source: str, problem: str, line: int | None = None) -> None:
        self.source = source
        self.problem = problem
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {problem}")


def parse_manifests(name: str, text: str) -> list[dict[str, Any]]:
    """Every object in `text`, in order, with `kind: List` items spliced in where the list stood."""
    documents = _json_documents(text)
    if documents is None:
        try:
            documents = list(yaml.load_all(text, Loader=_Loader))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = ": ".join(part for part in (exc.context, exc.problem) if part)
            raise ManifestError(name, problem or "invalid YAML", mark.line + 1 if mark else None) from exc
        except yaml.YAMLError as exc:
            raise ManifestError(name, f"invalid YAML: {exc}") from exc
    objects: list[dict[str, Any]] = []
    for number, document in enumerate(documents, start=1):
        if document is None:  # an empty document, e.g. after a trailing `---`
            continue
        if not isinstance(document, dict):
            raise ManifestError(name, f"document {number} is a {type(document).__name__}, not an object")
        if document.get("kind") == "List":
            items = document.get("items") or []
            if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
                raise ManifestError(name, f"document {number}: List items must be objects")
            objects.extend(items)
        else:
            objects.append(document)
    return objects


def read_manifests(path: str | Path) -> list[dict[str, Any]]:
    """`parse_manifests` on a UTF-8 file; unreadable files raise ManifestError too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(str(path), f"cannot read: {exc}") from exc
    return parse_manifests(str(path), text)


def _json_documents(text: str) -> list[Any] | None:
    """The one JSON document in `text`, or None to let the YAML parser (and its errors) decide."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        return [json.loads(text)]
    except ValueError:
        return None
