"""Pure pieces of the fake API server: patches, server-side apply field sets, selectors, validation.

Nothing here does I/O or knows about HTTP; kube_api.py calls these and turns `Invalid`,
`ApplyConflict` and `BadSelector` into Status bodies. Objects are plain JSON dicts, never mutated
in place: every function returns new values.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

Path = tuple[str, ...]  # fieldsV1 elements: "f:<field>" or 'k:{"type":"Ready"}'
MISSING: Any = object()

# Lists merged per item on apply (x-kubernetes-list-type: map), by the path of the list and its key.
LIST_MAPS: dict[tuple[str, ...], str] = {("status", "conditions"): "type"}
# Objects replaced whole on apply and owned as one field (x-kubernetes-map-type: atomic), by path.
ATOMIC_MAPS: frozenset[tuple[str, ...]] = frozenset({("maps",)})


class Invalid(Exception):
    """The object breaks a validation rule: 422 Invalid (or 400 for a malformed patch)."""

    def __init__(self, message: str, *, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


class ApplyConflict(Exception):
    """Apply would change fields another manager owns, without force: 409 Conflict."""


class BadSelector(Exception):
    """A label or field selector that does not parse: 400 BadRequest."""


# --- RFC 7386 merge patch and RFC 6902 JSON patch ------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise Invalid(f"json patch path {path!r} does not start with /", code=400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise Invalid(f"json patch path /{'/'.join(parts)} does not exist", code=422)
    return doc


def _json_patch_add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        index = len(parent) if last == "-" else int(last) if last.isdigit() else -1
        if not 0 <= index <= len(parent):
            raise Invalid(f"json patch index {last} out of range", code=422)
        parent.insert(index, value)
    else:
        raise Invalid("json patch parent is not a container", code=422)
    return doc


def _json_patch_remove(doc: Any, parts: list[str]) -> Any:
    parent = _resolve(doc, parts[:-1])
    _resolve(doc, parts)
    if isinstance(parent, dict):
        del parent[parts[-1]]
    else:
        del parent[int(parts[-1])]
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise Invalid("a json patch must be a list of operations", code=400)
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise Invalid(f"malformed json patch operation {op!r}", code=400)
        parts = _pointer(op["path"])
        kind = op["op"]
        if kind == "add":
            doc = _json_patch_add(doc, parts, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _json_patch_remove(doc, parts)
        elif kind == "replace":
            doc = _json_patch_add(_json_patch_remove(doc, parts), parts, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            source = _pointer(op["from"])
            value = copy.deepcopy(_resolve(doc, source))
            if kind == "move":
                doc = _json_patch_remove(doc, source)
            doc = _json_patch_add(doc, parts, value)
        elif kind == "test":
            if _resolve(doc, parts) != op.get("value"):
                raise Invalid(f"json patch test failed at {op['path']}", code=422)
        else:
            raise Invalid(f"unknown json patch operation {kind!r}", code=400)
    return doc


# --- server-side apply ------------------------------------------------------------------------------


def _list_map_key(names: tuple[str, ...]) -> str | None:
    return LIST_MAPS.get(names)


def _item_element(key: str, item: Mapping[str, Any]) -> str:
    return "k:" + json.dumps({key: item.get(key)}, separators=(",", ":"), sort_keys=True)


def field_paths(obj: Mapping[str, Any], names: tuple[str, ...] = (), prefix: Path = ()) -> set[Path]:
    """The leaf fields (and list-map items) of `obj` as fieldsV1 paths; atomic lists are leaves."""
    paths: set[Path] = set()
    for field, value in obj.items():
        here = prefix + (f"f:{field}",)
        field_names = names + (field,)
        key = _list_map_key(field_names)
        if isinstance(value, dict) and value and field_names not in ATOMIC_MAPS:
            paths |= field_paths(value, field_names, here)
        elif isinstance(value, list) and key is not None:
            for item in value:
                if isinstance(item, dict):
                    item_path = here + (_item_element(key, item),)
                    paths.add(item_path)
                    paths |= field_paths(item, (), item_path)
        else:
            paths.add(here)
    return paths


def value_at(obj: Any, path: Path) -> Any:
    for element in path:
        if element.startswith("f:"):
            if not isinstance(obj, dict) or element[2:] not in obj:
                return MISSING
            obj = obj[element[2:]]
        else:
            wanted = json.loads(element[2:])
            if not isinstance(obj, list):
                return MISSING
            match = [i for i in obj if isinstance(i, dict) and all(i.get(k) == v for k, v in wanted.items())]
            if not match:
                return MISSING
            obj = match[0]
    return obj


def _is_item(path: Path) -> bool:
    return path[-1].startswith("k:")


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Remove the field or list-map item at `path` from `obj` (mutates `obj`, a private copy)."""
    parent = value_at(obj, path[:-1]) if len(path) > 1 else obj
    last = path[-1]
    if parent is MISSING:
        return
    if last.startswith("f:") and isinstance(parent, dict):
        parent.pop(last[2:], None)
    elif isinstance(parent, list):
        wanted = json.loads(last[2:])
        parent[:] = [i for i in parent if not (isinstance(i, dict) and all(i.get(k) == v for k, v in wanted.items()))]


def merge_applied(current: Any, applied: Any, names: tuple[str, ...] = ()) -> Any:
    """Overlay an apply configuration: maps merge, list-maps merge per key, everything else replaces."""
    if isinstance(current, dict) and isinstance(applied, dict) and names not in ATOMIC_MAPS:
        result = dict(current)
        for field, value in applied.items():
            result[field] = merge_applied(current.get(field, MISSING), value, names + (field,))
        return result
    key = _list_map_key(names)
    if key is not None and isinstance(current, list) and isinstance(applied, list):
        result_list = list(current)
        for item in applied:
            index = next(
                (n for n, old in enumerate(result_list) if isinstance(old, dict) and old.get(key) == item.get(key)),
                None,
            )
            if index is None:
                result_list.append(copy.deepcopy(item))
            else:
                result_list[index] = merge_applied(result_list[index], item, ())
        return result_list
    return copy.deepcopy(applied)


@dataclass(frozen=True)
class Ownership:
    """Fields one manager owns, as a managedFields entry does."""

    manager: str
    operation: str  # "Apply" | "Update"
    subresource: str  # "" | "status"
    paths: frozenset[Path]
    time: str


def apply(
    current: dict[str, Any],
    applied: dict[str, Any],
    owners: list[Ownership],
    *,
    manager: str,
    subresource: str,
    force: bool,
    now: str,
) -> tuple[dict[str, Any], list[Ownership]]:
    """Server-side apply of `applied` (already cut to the fields this endpoint may set) by `manager`.

    Returns the new object and the new ownership list; raises ApplyConflict when another manager
    owns a field the configuration sets to a different value, unless `force`.
    """
    wanted = field_paths(applied)
    mine = next((o for o in owners if o.manager == manager and o.operation == "Apply" and o.subresource == subresource), None)
    others = [o for o in owners if o is not mine]
    conflicts: list[str] = []
    for other in others:
        for path in sorted(other.paths & wanted):
            if not _is_item(path) and value_at(current, path) != value_at(applied, path):
                conflicts.append(f'conflict with "{other.manager}": .{".".join(e[2:] for e in path)}')
    if conflicts and not force:
        raise ApplyConflict(f"Apply failed with {len(conflicts)} conflict(s): " + "; ".join(conflicts))
    if force:
        taken = {p for p in wanted if not _is_item(p)}
        others = [o if not (o.paths & taken) else _replace_paths(o, o.paths - taken) for o in others]
    result = copy.deepcopy(current)
    still_owned = frozenset().union(*(o.paths for o in others))
    dropped = (mine.paths if mine else frozenset()) - wanted
    # Items first would make their fields vanish with them; that is what we want, so sort by length.
    for path in sorted(dropped, key=len):
        held_elsewhere = any(p[: len(path)] == path for p in still_owned)
        if not held_elsewhere:
            _remove(result, path)
    result = merge_applied(result, applied)
    if mine is not None and mine.paths == frozenset(wanted):
        entry = mine
    else:
        entry = Ownership(manager, "Apply", subresource, frozenset(wanted), now)
    new_owners = [o for o in others if o.paths] + ([entry] if entry.paths else [])
    return result, new_owners


def _replace_paths(owner: Ownership, paths: frozenset[Path]) -> Ownership:
    return Ownership(owner.manager, owner.operation, owner.subresource, paths, owner.time)


def record_update(
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any],
    owners: list[Ownership],
    *,
    manager: str,
    subresource: str,
    now: str,
    scope: Iterable[str],
) -> list[Ownership]:
    """Ownership after a PUT/POST/non-apply PATCH: the writer takes every field it changed."""
    old_view = {k: v for k, v in (old or {}).items() if k in scope}
    new_view = {k: v for k, v in new.items() if k in scope}
    new_paths = field_paths(new_view)
    gone = field_paths(old_view) - new_paths
    changed = {p for p in new_paths if value_at(old_view, p) != value_at(new_view, p)}
    changed = {p for p in changed if not _is_item(p) or value_at(old_view, p) is MISSING}
    result: list[Ownership] = []
    mine: Ownership | None = None
    for owner in owners:
        if owner.manager == manager and owner.operation == "Update" and owner.subresource == subresource:
            mine = owner
            continue
        kept = owner.paths - changed - gone
        result.append(owner if kept == owner.paths else _replace_paths(owner, frozenset(kept)))
    mine_paths = ((mine.paths if mine else frozenset()) - gone) | changed
    if mine is not None and mine_paths == mine.paths:
        result.append(mine)
    elif mine_paths:
        result.append(Ownership(manager, "Update", subresource, frozenset(mine_paths), now))
    return [o for o in result if o.paths]


def fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for element in path:
            node = node.setdefault(element, {})
        if _is_item(path):
            node["."] = {}
    return tree


# --- selectors ------------------------------------------------------------------------------------

_SELECTOR_TERM = re.compile(
    r"\s*(?:(?P<key>[A-Za-z0-9_./-]+)\s*(?P<op>==|=|!=|>|<)\s*(?P<value>[A-Za-z0-9_.-]*)"
    r"|(?P<setkey>[A-Za-z0-9_./-]+)\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\)"
    r"|(?P<not>!)?\s*(?P<exists>[A-Za-z0-9_./-]+))\s*(?:,|$)"
)
# What apimachinery's validation asks of a label key (a qualified name) and a label value.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _check_label_key(key: str) -> None:
    prefix, slash, name = key.rpartition("/")
    if len(name) > 63 or not _LABEL_NAME.match(name):
        raise BadSelector(f"unable to parse requirement: invalid label key {key!r}: name part must consist of alphanumeric characters, '-', '_' or '.'")
    if slash and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        raise BadSelector(f"unable to parse requirement: invalid label key {key!r}: prefix part must be a lowercase RFC 1123 subdomain")


def _check_label_value(value: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise BadSelector(f"unable to parse requirement: invalid label value: {value!r}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.'")


def parse_selector(text: str | None) -> list[tuple[str, str, frozenset[str]]]:
    """`k=v,k2!=v2,k3 in (a,b),k4,!k5,k6>3` as (key, op, values) terms; ops: in, notin, exists,
    !exists, gt, lt. Keys and values are validated as the API server does: a malformed selector is
    BadSelector (400), never a selector that matches something."""
    terms: list[tuple[str, str, frozenset[str]]] = []
    if not text or not text.strip():
        return terms
    position = 0
    while position < len(text):
        match = _SELECTOR_TERM.match(text, position)
        if not match or match.end() == position:
            raise BadSelector(f"unable to parse requirement at {text[position:]!r}")
        position = match.end()
        if match["key"]:
            _check_label_key(match["key"])
            _check_label_value(match["value"])
            op = {"!=": "notin", ">": "gt", "<": "lt"}.get(match["op"], "in")
            if op in ("gt", "lt") and not re.fullmatch(r"[0-9]+", match["value"]):
                raise BadSelector(f"unable to parse requirement: for 'Gt', 'Lt' operators, the value must be an integer: {match['value']!r}")
            terms.append((match["key"], op, frozenset([match["value"]])))
        elif match["setkey"]:
            _check_label_key(match["setkey"])
            places = [v.strip() for v in match["values"].split(",")]
            if any(" " in v or "\t" in v for v in places):
                raise BadSelector(f"unable to parse requirement: found {match['values']!r}, expected: ',' or ')'")
            for value in places:
                _check_label_value(value)
            terms.append((match["setkey"], match["setop"], frozenset(places)))
        else:
            _check_label_key(match["exists"])
            terms.append((match["exists"], "!exists" if match["not"] else "exists", frozenset()))
    if text.rstrip().endswith(","):
        raise BadSelector("unable to parse requirement: found '', expected: identifier after ','")
    return terms


def selector_matches(terms: list[tuple[str, str, frozenset[str]]], labels: Mapping[str, str]) -> bool:
    for key, op, values in terms:
        present = key in labels
        if op == "in" and not (present and labels[key] in values):
            return False
        if op == "notin" and present and labels[key] in values:
            return False
        if op == "exists" and not present:
            return False
        if op == "!exists" and present:
            return False
        if op in ("gt", "lt"):
            (bound,) = values
            if not (present and re.fullmatch(r"[0-9]+", labels[key])):
                return False
            number, limit = int(labels[key]), int(bound)
            if not (number > limit if op == "gt" else number < limit):
                return False
    return True


def field_selector_values(obj: Mapping[str, Any]) -> dict[str, str]:
    metadata = obj.get("metadata", {})
    return {"metadata.name": metadata.get("name", ""), "metadata.namespace": metadata.get("namespace", "")}


# --- validation (what the CRD schemas and metav1 would reject) -------------------------------------

DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GATEWAY_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CONDITION_TYPE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def validate_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise Invalid("metadata.name: Required value: name or generateName is required")
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        raise Invalid(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain is required")


def _is_rfc3339(value: Any) -> bool:
    if not isinstance(value, str) or not _RFC3339.match(value):
        return False
    try:
        datetime.fromisoformat(value.replace("z", "Z").replace("t", "T"))
    except ValueError:
        return False
    return True


def validate_conditions(status: Any) -> None:
    """status.conditions as metav1.Condition's OpenAPI schema and the list-map rule would check."""
    if not isinstance(status, dict) or "conditions" not in status:
        return
    conditions = status["conditions"]
    if not isinstance(conditions, list):
        raise Invalid("status.conditions: Invalid value: must be an array")
    seen: set[str] = set()
    for index, condition in enumerate(conditions):
        where = f"status.conditions[{index}]"
        if not isinstance(condition, dict):
            raise Invalid(f"{where}: Invalid value: must be an object")
        for field in ("type", "status", "reason", "message", "lastTransitionTime"):
            if field not in condition:
                raise Invalid(f"{where}.{field}: Required value")
        ctype, reason, message = condition["type"], condition["reason"], condition["message"]
        if not isinstance(ctype, str) or len(ctype) > 316 or not _CONDITION_TYPE.match(ctype):
            raise Invalid(f"{where}.type: Invalid value: {ctype!r}: must be a qualified name of at most 316 characters")
        if ctype in seen:
            raise Invalid(f"{where}: Duplicate value: map[string]interface {{}}{{\"type\":{ctype!r}}}")
        seen.add(ctype)
        if condition["status"] not in ("True", "False", "Unknown"):
            raise Invalid(f'{where}.status: Unsupported value: {condition["status"]!r}: supported values: "True", "False", "Unknown"')
        if not isinstance(reason, str) or not 1 <= len(reason) <= 1024 or not _CONDITION_REASON.match(reason):
            raise Invalid(f"{where}.reason: Invalid value: {reason!r}: should match {_CONDITION_REASON.pattern}")
        if not isinstance(message, str) or len(message) > 32768:
            raise Invalid(f"{where}.message: Too long: may not be longer than 32768")
        if not _is_rfc3339(condition["lastTransitionTime"]):
            raise Invalid(f"{where}.lastTransitionTime: Invalid value: {condition['lastTransitionTime']!r}: must be an RFC 3339 date-time")
        generation = condition.get("observedGeneration", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise Invalid(f"{where}.observedGeneration: Invalid value: {generation!r}: should be greater than or equal to 0")


def validate_httproute(obj: Mapping[str, Any]) -> None:
    """The Gateway API v1 HTTPRoute CRD's limits that our adapter can run into."""
    spec = obj.get("spec") or {}
    hostnames = spec.get("hostnames") or []
    if len(hostnames) > 16:
        raise Invalid(f"spec.hostnames: Too many: {len(hostnames)}: must have at most 16 items")
    for index, host in enumerate(hostnames):
        if not isinstance(host, str) or not 1 <= len(host) <= 253 or not _GATEWAY_HOSTNAME.match(host):
            raise Invalid(f"spec.hostnames[{index}]: Invalid value: {host!r}: must be a valid hostname")
    rules = spec.get("rules") or []
    if len(rules) > 16:
        raise Invalid(f"spec.rules: Too many: {len(rules)}: must have at most 16 items")
    for r, rule in enumerate(rules):
        refs = (rule or {}).get("backendRefs") or []
        if len(refs) > 16:
            raise Invalid(f"spec.rules[{r}].backendRefs: Too many: {len(refs)}: must have at most 16 items")
        for b, ref in enumerate(refs):
            where = f"spec.rules[{r}].backendRefs[{b}]"
            name = ref.get("name")
            if not isinstance(name, str) or not 1 <= len(name) <= 253:
                raise Invalid(f"{where}.name: Required value")
            weight = ref.get("weight", 1)
            if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= 1_000_000:
                raise Invalid(f"{where}.weight: Invalid value: {weight!r}: must be between 0 and 1000000")


_REGION_REPORT_FIELDS = frozenset({"apiVersion", "kind", "metadata", "region", "maps"})
_VERDICT_FIELDS = frozenset({"observedGeneration", "status", "reason", "message", "lastTransitionTime", "uid"})


def validate_region_report(obj: Mapping[str, Any]) -> None:
    """A RegionReport as the chart's CRD schema checks it (unknown fields are refused here, where a
    real server would prune them, so a writer's typo shows)."""
    unknown = sorted(set(obj) - _REGION_REPORT_FIELDS)
    if unknown:
        raise Invalid(f"{unknown[0]}: Forbidden: field not declared in the schema")
    if not isinstance(obj.get("region", ""), str):
        raise Invalid("region: Invalid value: must be a string")
    maps = obj.get("maps", {})
    if not isinstance(maps, dict):
        raise Invalid("maps: Invalid value: must be an object")
    for name, entry in maps.items():
        where = f"maps[{name}]"
        if not isinstance(entry, dict):
            raise Invalid(f"{where}: Invalid value: must be an object")
        extra = sorted(set(entry) - _VERDICT_FIELDS)
        if extra:
            raise Invalid(f"{where}.{extra[0]}: Forbidden: field not declared in the schema")
        for required in ("status", "reason", "lastTransitionTime"):
            if required not in entry:
                raise Invalid(f"{where}.{required}: Required value")
        if entry["status"] not in ("True", "False", "Unknown"):
            raise Invalid(f"{where}.status: Unsupported value: {entry['status']!r}")
        reason = entry["reason"]
        if not isinstance(reason, str) or not 1 <= len(reason) <= 1024 or not _CONDITION_REASON.match(reason):
            raise Invalid(f"{where}.reason: Invalid value: {reason!r}")
        message = entry.get("message", "")
        if not isinstance(message, str) or len(message) > 32768:
            raise Invalid(f"{where}.message: Too long: may not be longer than 32768")
        generation = entry.get("observedGeneration", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise Invalid(f"{where}.observedGeneration: Invalid value: {generation!r}: must be >= 0")
        if not _is_rfc3339(entry["lastTransitionTime"]):
            raise Invalid(f"{where}.lastTransitionTime: Invalid value: {entry['lastTransitionTime']!r}")
