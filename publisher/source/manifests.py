"""Kubernetes manifests from text: YAML or JSON, one object, several YAML documents, or a `kind: List`.

`parse_manifests(name, text)` is pure: raw object dicts in input order, or a ManifestError naming
the input (and the line, where the parser knows it). `read_manifests(path)` is the thin file-reading
wrapper. Neither validates objects: that is the model's job, but both refuse input no manifest
needs (too large, nested too deep, or expanding through YAML aliases) before anything walks it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ManifestError", "parse_manifests", "read_manifests"]

_TIMESTAMP = "tag:yaml.org,2002:timestamp"
# 10,000 four-entry maps in one file are about 15 MB; nothing larger is a manifest file.
MAX_BYTES = 64 * 1024 * 1024
# A TrafficMap is about 8 levels deep; Python's own recursion limit sits near 1,000.
MAX_DEPTH = 100
# Values after YAML aliases are expanded: a billion-laughs file is refused before json.dumps sees it.
MAX_NODES = 10_000_000


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
    if len(text) > MAX_BYTES:
        raise ManifestError(name, f"larger than {MAX_BYTES:,} bytes")
    try:
        documents = _json_documents(text)
        if documents is None:
            documents = list(yaml.load_all(text, Loader=_Loader))
    except RecursionError:
        raise ManifestError(name, f"nested deeper than {MAX_DEPTH} levels") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = ": ".join(part for part in (exc.context, exc.problem) if part)
        raise ManifestError(name, problem or "invalid YAML", mark.line + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise ManifestError(name, f"invalid YAML: {exc}") from exc
    problem = _shape_problem(documents)
    if problem is not None:
        raise ManifestError(name, problem)
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
        with Path(path).open("rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ManifestError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    if len(data) > MAX_BYTES:
        raise ManifestError(str(path), f"larger than {MAX_BYTES:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(str(path), f"cannot read: not UTF-8: {exc}") from exc
    return parse_manifests(str(path), text)


def _json_documents(text: str) -> list[Any] | None:
    """The one JSON document in `text`, or None to let the YAML parser (and its errors) decide."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        return [json.loads(text)]
    except ValueError:
        return None


def _shape_problem(documents: list[Any]) -> str | None:
    """Why these parsed values are no manifest (too deep, self-referring or too many values once
    YAML aliases are expanded), or None. Iterative, and each shared value is measured once."""
    height: dict[int, int] = {}
    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(documents, False)]
    open_ids: set[int] = set()
    while stack:
        value, children_done = stack.pop()
        ident = id(value)
        children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None or ident in height:
            continue
        if children_done:
            open_ids.discard(ident)
            containers = [c for c in children if isinstance(c, (dict, list))]
            height[ident] = 1 + max((height[id(c)] for c in containers), default=0)
            size[ident] = 1 + len(children) + sum(size[id(c)] for c in containers)
            if height[ident] > MAX_DEPTH + 1:  # +1: the list of documents itself
                return f"nested deeper than {MAX_DEPTH} levels"
            if size[ident] > MAX_NODES:
                return f"more than {MAX_NODES:,} values once YAML aliases are expanded"
            continue
        if ident in open_ids:
            return "a YAML alias refers to a value that contains it"
        open_ids.add(ident)
        stack.append((value, True))
        for child in children:
            if isinstance(child, (dict, list)):
                if id(child) in open_ids:
                    return "a YAML alias refers to a value that contains it"
                stack.append((child, False))
    return None
