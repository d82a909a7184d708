"""NGINX Lua mode's confirmed table (pure): what NGINX confirmed it holds, the batches that change
it, and whether NGINX's answer confirms one. LuaTransport owns one and does the I/O.

Each entry's hash is kept, so the checksum NGINX must answer after a batch costs O(changed maps).
After an NGINX restart (a new boot id, an empty table) the whole confirmed table is pushed again;
a table that fails its own checksum is replaced whole by what NGINX confirmed under that boot, or,
with nothing confirmed under it, by what it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.nginx.lua_render import CHECKSUM_MODULUS, LuaPart, decode_entry, entry_hash, map_key
from publisher.core.values import MapKey

__all__ = ["Batch", "ConfirmedTable", "TableRead", "read_table"]


@dataclass(frozen=True, slots=True)
class TableRead:
    """NGINX's table as GET /table lists it: each map's entry text, the same decoded, the addresses
    by name the entries hold, each entry's hash and their checksum."""

    entries: dict[MapKey, str]
    parts: dict[MapKey, LuaPart]
    addresses: dict[str, tuple[str, ...]]
    hashes: dict[MapKey, int]
    total: int

    def matches(self, checksum: object) -> bool:
        """Whether the entries add up to `checksum`, the one NGINX keeps of its table."""
        return f"{self.total:013x}" == checksum


def read_table(lines: str) -> TableRead:
    """GET /table's lines after its head, one per map: "namespace/name entry-text". Raises
    ValueError on an entry `entry_text` did not write."""
    entries: dict[MapKey, str] = {}
    parts: dict[MapKey, LuaPart] = {}
    names: dict[str, tuple[str, ...]] = {}
    for line in lines.splitlines():
        name, _, text = line.partition(" ")
        key = map_key(name)
        parts[key], addresses = decode_entry(text)
        names.update(addresses)
        entries[key] = text
    hashes = {key: entry_hash(key, text) for key, text in entries.items()}
    return TableRead(entries, parts, names, hashes, sum(hashes.values()) % CHECKSUM_MODULUS)


@dataclass(frozen=True, slots=True)
class Batch:
    """One POST /batch, expected under boot id `boot`: entry texts to set (`parts`: the same maps
    decoded, `hashes`: their hashes) and maps to delete, or with `replace` the whole table instead.
    `total`: the checksum NGINX keeps once it holds the batch."""

    boot: str | None
    sets: Mapping[MapKey, str]
    parts: Mapping[MapKey, LuaPart]
    deletes: Sequence[MapKey]
    replace: bool
    hashes: Mapping[MapKey, int]
    total: int

    @property
    def checksum(self) -> str:
        return f"{self.total:013x}"

    @property
    def maps(self) -> int:
        return len(self.sets) + len(self.deletes)

    def body(self) -> str:
        """The format ome_table.parse_batch reads: a JSON head line, then one line per change."""
        lines = [json.dumps({"expect_boot": self.boot, "replace": self.replace})]
        lines += [f"set {key} {text}" for key, text in self.sets.items()]
        lines += [f"delete {key}" for key in self.deletes]
        return "\n".join(lines)


class ConfirmedTable:
    """What NGINX confirmed it holds under boot id `boot` at `version`: each map's entry text, the
    same decoded, each entry's hash and their checksum."""

    def __init__(self) -> None:
        # The boot id NGINX confirmed the table under; None: unknown, read it back first.
        self.boot: str | None = None
        self.version = 0
        # The boot id the entries were confirmed under: kept when `boot` is forgotten, so a table
        # that no longer matches its checksum is repaired from them.
        self.entries_boot: str | None = None
        self._entries: dict[MapKey, str] = {}
        self._parts: dict[MapKey, LuaPart] = {}
        self._hashes: dict[MapKey, int] = {}
        self._sum = 0

    @property
    def entries(self) -> Mapping[MapKey, str]:
        return self._entries

    @property
    def parts(self) -> Mapping[MapKey, LuaPart]:
        """The confirmed maps decoded. A restore replaces the dict: a reader iterating it while a
        batch is confirmed asks again for each map."""
        return self._parts

    @property
    def checksum(self) -> str:
        return f"{self._sum:013x}"

    def holds(self, answer: Mapping[str, Any]) -> bool:
        """Whether `answer` names the confirmed version and checksum."""
        return answer.get("version") == self.version and answer.get("checksum") == self.checksum

    def forget_boot(self) -> None:
        """What NGINX holds is unknown: the next call reads it back (the entries stay, for a repair)."""
        self.boot = None

    def adopt(self, boot: str, version: int, read: TableRead) -> None:
        """Take what NGINX lists, which matches its checksum, as confirmed."""
        self.boot, self.version, self._sum, self.entries_boot = boot, version, read.total, boot
        self._entries, self._parts, self._hashes = read.entries, read.parts, read.hashes

    def using(self, names: frozenset[str]) -> dict[MapKey, LuaPart]:
        """The confirmed maps with a backend named in `names`."""
        return {key: part for key, part in self._parts.items() if any(b.name in names for b in part.backends)}

    def changes(self, wanted: Mapping[MapKey, LuaPart | None], entry_of: Callable[[LuaPart], str]) -> Batch | None:
        """The batch that makes each map of `wanted` hold the entry `entry_of` gives its part (None:
        deleted), leaving out what the table already holds; None when that is nothing."""
        sets: dict[MapKey, str] = {}
        parts: dict[MapKey, LuaPart] = {}
        deletes: list[MapKey] = []
        for key, part in wanted.items():
            if part is None:
                if key in self._entries:
                    deletes.append(key)
                continue
            text = entry_of(part)
            if self._entries.get(key) != text:
                sets[key], parts[key] = text, part
        return self.batch(sets, parts, deletes) if sets or deletes else None

    def batch(self, sets: Mapping[MapKey, str], parts: Mapping[MapKey, LuaPart], deletes: Sequence[MapKey]) -> Batch:
        """A batch of changes under the confirmed boot id."""
        hashes = {key: entry_hash(key, text) for key, text in sets.items()}
        total = self._sum + sum(hashes.values())
        total -= sum(self._hashes.get(key, 0) for key in (*sets, *deletes))
        return Batch(self.boot, sets, parts, deletes, False, hashes, total % CHECKSUM_MODULUS)

    def restore(self, boot: str) -> Batch:
        """The whole confirmed table for NGINX under a new boot id (a restart emptied it)."""
        return self._whole(boot, self._entries, self._parts)

    def repair(self, boot: str, read: TableRead) -> Batch:
        """The whole table for an NGINX whose table (`read`) fails its checksum: what it confirmed
        under this boot, or, with nothing confirmed under it, what it holds."""
        if self.entries_boot == boot:
            return self._whole(boot, self._entries, self._parts)
        return self._whole(boot, read.entries, read.parts)

    def confirm(self, batch: Batch, answer: Mapping[str, Any]) -> bool:
        """Whether NGINX's `answer` confirms `batch` (its boot id, a newer version, the expected
        checksum); if so the table holds it, else the boot is forgotten: what NGINX holds is unknown."""
        version = int(answer.get("version", 0))
        previous = 0 if batch.replace else self.version
        if answer.get("boot") != batch.boot or version <= previous or answer.get("checksum") != batch.checksum:
            self.forget_boot()
            return False
        if batch.replace:
            self._entries, self._parts, self._hashes = {}, {}, {}
        for key in batch.deletes:
            del self._entries[key], self._parts[key], self._hashes[key]
        self._entries.update(batch.sets)
        self._parts.update(batch.parts)
        self._hashes.update(batch.hashes)
        self.boot, self.version, self._sum, self.entries_boot = batch.boot, version, batch.total, batch.boot
        return True

    def _whole(self, boot: str, entries: Mapping[MapKey, str], parts: Mapping[MapKey, LuaPart]) -> Batch:
        # Copies: the batch stays what was sent while the table changes.
        sets, decoded = dict(entries), dict(parts)
        hashes = {key: entry_hash(key, text) for key, text in sets.items()}
        return Batch(boot or self.boot, sets, decoded, [], True, hashes, sum(hashes.values()) % CHECKSUM_MODULUS)
