"""Adapter `json`: every Publication in one JSON file, for tests and for gateways that reload a file.

The file is `{"publications": [...]}`, sorted by namespace and name, written atomically and only
when its content changes, and read back after each write and at start.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from adapters.base import ApplyResult, Rejected, Unavailable, write_atomic
from publisher.model import Held, MapKey, Publication


class JsonOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    json_path: Path = Field(description="The file the adapter owns; its directory must exist and be writable.")


def render_publication(pub: Publication) -> bytes:
    return json.dumps(pub.to_json(), separators=(",", ":")).encode()


def render(fragments: Iterable[bytes]) -> bytes:
    """The whole file from each map's rendered fragment, given in namespace/name order. Fragments
    stay encoded, so a write of 10,000 maps costs one join, not a re-render."""
    body = b",\n".join(fragments)
    return b'{"publications": [\n' + body + b"\n]}\n" if body else b'{"publications": []}\n'


def parse(data: bytes) -> dict[MapKey, Publication]:
    document = json.loads(data)
    pubs = [Publication.from_json(item) for item in document["publications"]]
    return {pub.key: pub for pub in pubs}


class JsonAdapter:
    name = "json"

    def __init__(self, options: JsonOptions) -> None:
        self._path = options.json_path
        self._fragments: dict[MapKey, bytes] = {}
        self._written: bytes | None = None

    def check(self, pub: Publication) -> Held | None:
        return None

    async def current(self) -> dict[MapKey, Publication]:
        try:
            data = await asyncio.to_thread(self._path.read_bytes)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise Unavailable(f"cannot read {self._path}: {exc}") from exc
        try:
            held = parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            # Not ours to repair silently: a file we cannot read back must be looked at.
            raise Rejected(f"{self._path} is not a publications file: {exc}") from exc
        self._written = data
        self._fragments = {key: render_publication(held[key]) for key in sorted(held)}
        return held

    async def apply(self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]) -> ApplyResult:
        # Work on a copy: a failed write must leave the fragments matching the file.
        # Fragments are kept in key order; an update keeps its place, so only a new key re-sorts.
        fragments = dict(self._fragments)
        new_key = False
        for key in changed:
            pub = desired.get(key)
            if pub is None:
                fragments.pop(key, None)
            else:
                new_key = new_key or key not in fragments
                fragments[key] = render_publication(pub)
        if new_key:
            fragments = {key: fragments[key] for key in sorted(fragments)}
        data = render(fragments.values())
        if data == self._written:
            self._fragments = fragments
            return ApplyResult(wrote=False)
        try:
            await asyncio.to_thread(write_atomic, self._path, data)
            confirmed = await asyncio.to_thread(self._path.read_bytes)
        except OSError as exc:
            raise Unavailable(f"cannot write {self._path}: {exc}") from exc
        if confirmed != data:
            raise Unavailable(f"{self._path} changed under us while writing")
        self._written, self._fragments = data, fragments
        return ApplyResult(wrote=True)

    def hold_off(self) -> float:
        return 0.0

    async def aclose(self) -> None:
        return None
