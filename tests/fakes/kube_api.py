"""A fake Kubernetes API server on real HTTP (127.0.0.1, port 0) for kubernetes_asyncio to talk to.

Resources: ome.io/v1beta1 trafficmaps and inferenceservices, gateway.networking.k8s.io/v1 httproutes
(all three with a status subresource), gateway-publisher.ome.io/v1alpha1 regionreports (the chart's
CRD, no status subresource), coordination.k8s.io/v1 leases, v1 services. All namespaced.

Promises, each tested in tests/fakes/test_kube_api.py:
1. Lists, namespaced and across namespaces, kind `<Kind>List` with metadata.resourceVersion;
   `labelSelector` (`k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, `k>N`, `k<N`;
   a malformed one, keys and values checked as the API server does, is 400 BadRequest) and
   `fieldSelector` on metadata.name/namespace; `limit`/`continue` pages from one snapshot, every
   page carrying the first page's resourceVersion; a continue token that outlived its snapshot: 410.
2. GET, POST (create), PUT (replace, with a resourceVersion precondition: 409 Conflict), DELETE
   (with optional preconditions). Errors are real `Status` bodies: kind Status, apiVersion v1,
   status Failure, message, reason (NotFound, AlreadyExists, Conflict, Gone/Expired, Invalid,
   BadRequest, UnsupportedMediaType, MethodNotAllowed), code.
3. One global resourceVersion counter (a string of an integer), bumped by every write that changes
   something; a write that changes nothing is a no-op (same resourceVersion, no event). Create sets
   uid and creationTimestamp. For resources with a status subresource, metadata.generation starts
   at 1 and is bumped only when something outside metadata and status changes (the spec); a
   custom resource without one (regionreports) has it bumped by any change outside metadata.
   A PUT of a custom resource must carry metadata.resourceVersion (422 otherwise).
   Objects must be DNS-1123 subdomain names; a create of a CRD drops `status`.
4. Status subresource: PUT/PATCH on `.../{name}/status` changes only status; writes to the main
   resource keep the stored status.
5. PATCH: `application/merge-patch+json` (RFC 7386), `application/json-patch+json` (RFC 6902),
   `application/strategic-merge-patch+json` for built-in kinds only (handled as a merge patch; a
   CRD answers 415 like a real server), and server-side apply `application/apply-patch+yaml` (JSON
   or YAML body) needing `fieldManager` (400 without), with `force=true`. metadata.managedFields is
   kept per manager (Apply and Update entries, fieldsV1). `status.conditions` is a list-map keyed
   on `type`: an applied condition replaces that manager's entry of the same type, other managers'
   conditions survive, and a condition a manager applied before and now omits is removed unless
   another manager owns it. A field another manager owns with a different value: 409 without force.
   Apply to a missing object creates it (main resource) or answers 404 (status). A resourceVersion
   in a patch body is a precondition. Any other content type: 415.
6. Condition validation on trafficmaps status (metav1.Condition's schema): type (qualified name,
   <= 316), status True/False/Unknown, reason (pattern, 1..1024), message (<= 32768),
   lastTransitionTime (RFC 3339 with a zone), observedGeneration >= 0, no duplicate type -> 422.
   HTTPRoute validation: backendRefs weight 0..1,000,000, at most 16 backendRefs per rule and 16
   rules and hostnames, hostnames valid. RegionReport validation (the CRD's schema): `region` a
   string, `maps` an object of entries with status True/False/Unknown, a reason as a condition's,
   message <= 32768, observedGeneration >= 0, lastTransitionTime RFC 3339; no other top-level
   field. Its `maps` is atomic on apply (x-kubernetes-map-type: atomic): the applier replaces it
   whole and managedFields name `f:maps` alone.
7. Watch (`watch=true|1`) with resourceVersion, allowWatchBookmarks, timeoutSeconds, label and field
   selectors: newline-delimited JSON events ADDED, MODIFIED, DELETED, BOOKMARK, ERROR. From version N
   it replays the events after N out of a bounded history; N older than the history gives one ERROR
   event with a 410 Expired Status and ends the stream (or, with `expired_watch_as_http = True`, an
   HTTP 410). No version or "0": synthetic ADDED events for the current objects first. With
   `bookmark_interval` set, BOOKMARK events carry only kind, apiVersion and metadata.resourceVersion,
   and go out only when no event waits (never ahead of one). Events that queue while the stream is
   written go out in one write, as the API server flushes only when nothing waits.
8. Fault knobs: `expire_history()`, `drop_watches()`, `change_silently(obj)`, `set_latency(s)`,
   `fail_next(n, status=500, verb=None)`, `answer_next(n, body, verb=None)` (200 with a raw body: a
   proxy's page, a truncated list); `requests` records every call (verb, path, content type,
   fieldManager) and `count(...)` filters them; `in_flight` and `peak_in_flight` count requests being answered, now
   and at most. `refuse(401|403, verb=None, resource=None)` answers
   every matching request as a real server does without credentials (401 Unauthorized) or without
   an RBAC rule (403 Forbidden naming the user, verb, resource, group and scope) until `allow()`.
   `await go_down()` cuts every connection and refuses new ones (an outage; the store is kept) and
   `await come_back()` answers again on the same URL; `await restart()` is both.
   `uninstall(plural)` removes a custom resource's CRD as `kubectl delete crd` does: its objects
   are deleted (DELETED events), discovery no longer lists it, and every request for it answers 404
   NotFound "the server could not find the requested resource" until `install(plural)`.
9. Leases with optimistic concurrency, enough for kubernetes_asyncio.leaderelection's LeaseLock
   (read_namespaced_lease, create_namespaced_lease, replace_namespaced_lease) and for
   publisher.kube.LeaseLock (GET; POST answering 409 AlreadyExists to the second creator; PUT
   answering 409 Conflict to a stale resourceVersion).
10. `/version`, `/api` and `/apis` answer minimal documents.
11. What a real kubectl needs (see "kubectl" below): `/api/v1` and `/apis/{group}/{version}` answer
    an APIResourceList (name, singularName, namespaced, kind, verbs, shortNames, the status
    subresource), so `kubectl get trafficmap`, `-o jsonpath`, `-o custom-columns` and
    `kubectl wait --for=condition=...` resolve and work; a watch with `sendInitialEvents=true`
    (kubectl wait's watch-list) gets the current objects as ADDED, then a BOOKMARK annotated
    `k8s.io/initial-events-end: "true"`, then the changes. Tables are not served (kubectl then
    prints from the objects), nor is aggregated discovery or OpenAPI.
Not promised: other resources, cluster-scoped resources, dry-run, deletion with finalizers,
watch from a version newer than the current one (replays nothing instead of waiting).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic_core
import yaml
from aiohttp import web

from tests.fakes import _semantics as sem


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    status_subresource: bool
    builtin: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """`group/version/plural` (`v1/services` for the core group): how helpers name a resource."""
        return f"{self.api_version}/{self.plural}"

    @property
    def tracks_generation(self) -> bool:
        """metadata.generation is kept: every custom resource, as a real server keeps it."""
        return not self.builtin


RESOURCES: tuple[Resource, ...] = (
    Resource("ome.io", "v1beta1", "trafficmaps", "TrafficMap", True, False),
    Resource("ome.io", "v1beta1", "inferenceservices", "InferenceService", True, False),
    Resource("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute", True, False),
    Resource("gateway-publisher.ome.io", "v1alpha1", "regionreports", "RegionReport", False, False),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", False, True),
    Resource("", "v1", "services", "Service", False, True),
)
_BY_KEY = {r.key: r for r in RESOURCES}
_BY_KIND = {(r.api_version, r.kind): r for r in RESOURCES}

PATCH_MERGE = "application/merge-patch+json"
PATCH_JSON = "application/json-patch+json"
PATCH_STRATEGIC = "application/strategic-merge-patch+json"
PATCH_APPLY = "application/apply-patch+yaml"

ObjectKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class RecordedRequest:
    verb: str  # list, watch, get, create, update, patch, delete (or "other")
    path: str
    content_type: str
    field_manager: str | None
    # The bearer token the client sent (write_kubeconfig's `token`): which client asked, when several share the server.
    token: str | None = None


class _Signal:
    def __init__(self, name: str) -> None:
        self.name = name


_DROP = _Signal("drop")
_STOP = _Signal("stop")


@dataclass(eq=False)
class _Watcher:
    resource: Resource
    namespace: str | None
    labels: list[tuple[str, str, frozenset[str]]]
    fields: list[tuple[str, str, frozenset[str]]]
    queue: asyncio.Queue[bytes | _Signal] = field(default_factory=asyncio.Queue)

    def wants(self, namespace: str, name: str, labels: Mapping[str, str]) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        if not sem.selector_matches(self.labels, labels):
            return False
        return sem.selector_matches(self.fields, {"metadata.name": name, "metadata.namespace": namespace})


@dataclass(frozen=True)
class _HistoryEntry:
    rv: int
    resource: str
    namespace: str
    name: str
    labels: Mapping[str, str]
    line: bytes


class ApiError(Exception):
    """Answered as a Status body; raised anywhere inside a request."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


def status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_FAILURE_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Gone",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class FakeKubeAPI:
    """The fake server and its store. `async with FakeKubeAPI() as api: url = api.url`.

    Knobs: `history_size` (watch replay window, in events), `bookmark_interval` (seconds, None = no
    bookmarks), `expired_watch_as_http` (answer an expired watch with HTTP 410 instead of an ERROR
    event), `page_snapshots` (how many list snapshots `continue` tokens can reach).
    """

    def __init__(
        self,
        *,
        history_size: int = 10_000,
        bookmark_interval: float | None = None,
        expired_watch_as_http: bool = False,
        page_snapshots: int = 32,
    ) -> None:
        self.bookmark_interval = bookmark_interval
        self.expired_watch_as_http = expired_watch_as_http
        self.requests: list[RecordedRequest] = []
        self._rv = 100
        self._floor = self._rv  # every event after this version is still in the history
        self._history: collections.deque[_HistoryEntry] = collections.deque(maxlen=history_size)
        self._store: dict[str, dict[ObjectKey, dict[str, Any]]] = {r.key: {} for r in RESOURCES}
        self._owners: dict[tuple[str, str, str], list[sem.Ownership]] = {}
        self._watchers: dict[str, set[_Watcher]] = {r.key: set() for r in RESOURCES}
        self._snapshots: collections.OrderedDict[str, tuple[int, list[dict[str, Any]]]] = collections.OrderedDict()
        self._page_snapshots = page_snapshots
        self._latency = 0.0
        self._failures: list[tuple[int, str | None]] = []
        self._raw_answers: list[tuple[bytes, str | None]] = []
        self._refusals: list[tuple[int, str | None, str | None]] = []
        self._uninstalled: set[str] = set()  # plurals whose CRD is not installed
        self._port = 0
        self._runner: web.AppRunner | None = None
        self.in_flight = 0  # requests being answered (open watches included)
        self.peak_in_flight = 0  # the most requests answered at once
        # Events written to watch streams (bookmarks and ERRORs aside), per resource key, over
        # every watch ever opened: what the API server's fan-out sent.
        self.watch_events_sent: collections.Counter[str] = collections.Counter()
        self.url = ""

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self._port}"
        return self.url

    async def stop(self) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.queue.put_nowait(_STOP)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def go_down(self) -> None:
        """An outage: open watches are cut without an end of stream, the port stops listening, and
        the objects stay as they were for `come_back()`."""
        self.drop_watches()
        await asyncio.sleep(0)  # let the watch handlers abort their connections
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def come_back(self) -> None:
        """Answer again, on the same URL, with the same objects and versions."""
        await self.start()

    async def restart(self) -> None:
        await self.go_down()
        await self.come_back()

    async def __aenter__(self) -> FakeKubeAPI:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- store helpers for tests ------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store a new object as given (status included, no field manager) and emit ADDED."""
        resource = self._resource_of(obj)
        body = copy.deepcopy(dict(obj))
        namespace = body.get("metadata", {}).get("namespace", "default")
        stored = self._create(resource, namespace, body, manager="", keep_status=True, owners=[])
        return copy.deepcopy(stored)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        stored = self._store[_BY_KEY[resource].key].get((namespace, name))
        return copy.deepcopy(stored) if stored is not None else None

    def update(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an object whole (spec and status) and emit MODIFIED; returns the stored copy."""
        return copy.deepcopy(self._replace_whole(obj, emit=True))

    def change_silently(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store a change (new resourceVersion) that no watch will ever hear of."""
        return copy.deepcopy(self._replace_whole(obj, emit=False))

    def delete(self, resource: str, namespace: str, name: str) -> None:
        res = _BY_KEY[resource]
        if (namespace, name) not in self._store[res.key]:
            raise KeyError(f"{resource} {namespace}/{name} does not exist")
        self._delete(res, namespace, name)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        items = self._store[_BY_KEY[resource].key]
        return [copy.deepcopy(o) for (ns, _), o in sorted(items.items()) if namespace is None or ns == namespace]

    # --- fault knobs ------------------------------------------------------------------------------

    def expire_history(self) -> None:
        """Every version before now is too old: watches from it get 410, continue tokens too."""
        self._floor = self._rv
        self._history.clear()
        self._snapshots.clear()

    def drop_watches(self) -> None:
        """Cut every open watch connection without a clean end of stream."""
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.queue.put_nowait(_DROP)

    def set_latency(self, seconds: float) -> None:
        """Every request waits this long before it is answered; lowering it shortens the waits of
        requests already waiting (so a test can end a hang it started)."""
        self._latency = seconds

    async def _delay(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while (remaining := started + self._latency - loop.time()) > 0:
            await asyncio.sleep(min(remaining, 0.05))

    def fail_next(self, n: int, status: int = 500, *, verb: str | None = None) -> None:
        """The next `n` requests (of `verb`, when given) answer `status` with a Status body."""
        self._failures.extend([(status, verb)] * n)

    def answer_next(self, n: int, body: bytes, *, verb: str | None = None) -> None:
        """The next `n` requests (of `verb`, when given) answer 200 with `body` as it is."""
        self._raw_answers.extend([(body, verb)] * n)

    def refuse(self, status: int, *, verb: str | None = None, resource: str | None = None) -> None:
        """Answer every request (of `verb`, on the resource whose plural is `resource`, when given)
        with 401 Unauthorized or 403 Forbidden, worded as a real API server words them."""
        if status not in (401, 403):
            raise ValueError("refuse() is for 401 and 403; fail_next() injects other statuses")
        self._refusals.append((status, verb, resource))

    def allow(self) -> None:
        """Undo every `refuse()`."""
        self._refusals.clear()

    def uninstall(self, plural: str) -> None:
        """The CRD of `plural` is deleted: its objects go, and the API answers 404 for it."""
        resource = next(r for r in RESOURCES if r.plural == plural)
        if resource.builtin:
            raise ValueError("only a custom resource's CRD can be uninstalled")
        for namespace, name in list(self._store[resource.key]):
            self._delete(resource, namespace, name)
        self._uninstalled.add(plural)

    def install(self, plural: str) -> None:
        """The CRD of `plural` is installed (again): the API serves it, with no objects."""
        self._uninstalled.discard(plural)

    def _refusal(self, verb: str, route: tuple[Any, ...]) -> ApiError | None:
        if route[0] == "discovery":
            return None
        _, resource, namespace, _name, _subresource = route
        for status, want_verb, want_resource in self._refusals:
            if (want_verb is None or want_verb == verb) and (want_resource is None or want_resource == resource.plural):
                if status == 401:
                    return ApiError(401, "Unauthorized", "Unauthorized")
                what = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
                scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
                return ApiError(
                    403,
                    "Forbidden",
                    f'{what} is forbidden: User "system:serviceaccount:default:ome-gateway-publisher" cannot {verb} '
                    f'resource "{resource.plural}" in API group "{resource.group}" {scope}',
                    {"group": resource.group, "kind": resource.plural},
                )
        return None

    def count(
        self,
        verb: str | None = None,
        *,
        path: str | None = None,
        content_type: str | None = None,
        field_manager: str | None = None,
    ) -> int:
        return sum(
            1
            for r in self.requests
            if (verb is None or r.verb == verb)
            and (path is None or r.path == path)
            and (content_type is None or r.content_type == content_type)
            and (field_manager is None or r.field_manager == field_manager)
        )

    def watcher_count(self) -> int:
        return sum(len(w) for w in self._watchers.values())

    def watchers_open(self) -> dict[str, int]:
        """Watches open now, per resource key (those with none left out)."""
        return {key: len(w) for key, w in self._watchers.items() if w}

    # --- HTTP -------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        query = request.query
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        try:
            route = self._route(parts)
            verb = self._verb(request.method, route, query)
            token = request.headers.get("Authorization", "").removeprefix("Bearer ") or None
            self.requests.append(RecordedRequest(verb, request.path, content_type, query.get("fieldManager"), token))
            await self._delay()
            refusal = self._refusal(verb, route)
            if refusal is not None:
                raise refusal
            failure = next((f for f in self._failures if f[1] is None or f[1] == verb), None)
            if failure is not None:
                self._failures.remove(failure)
                code = failure[0]
                raise ApiError(code, _FAILURE_REASONS.get(code, "InternalError"), f"injected failure {code}")
            raw = next((a for a in self._raw_answers if a[1] is None or a[1] == verb), None)
            if raw is not None:
                self._raw_answers.remove(raw)
                return web.Response(body=raw[0], content_type="application/json")
            if route[0] == "discovery":
                return _json_response(route[1])
            _, resource, namespace, name, subresource = route
            if verb == "watch":
                return await self._watch(request, resource, namespace)
            if verb == "list":
                # Compact, by pydantic-core: a page of 500 maps in 3 ms, where json.dumps took 11
                # (a real API server serves lists from its cache, much faster than this fake).
                return web.Response(body=pydantic_core.to_json(self._list(resource, namespace, query)), content_type="application/json")
            assert namespace is not None
            manager = query.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
            if verb == "create":
                self._need_json(content_type)
                body = await self._body(request, False, content_type)
                return _json_response(self._http_create(resource, namespace, body, manager), status=201)
            assert name is not None
            if verb == "get":
                return _json_response(self._get(resource, namespace, name))
            if verb == "delete":
                return _json_response(self._http_delete(resource, namespace, name, await self._body(request, True)))
            body = await self._body(request, False, content_type)
            if verb == "update":
                self._need_json(content_type)
                return _json_response(self._http_replace(resource, namespace, name, subresource, body, manager))
            result, created = self._http_patch(resource, namespace, name, subresource, body, content_type, query, manager)
            return _json_response(result, status=201 if created else 200)
        except ApiError as error:
            return _json_response(status_body(error.code, error.reason, error.message, error.details), status=error.code)
        except sem.Invalid as error:
            reason = "Invalid" if error.code == 422 else "BadRequest"
            return _json_response(status_body(error.code, reason, str(error)), status=error.code)
        except sem.BadSelector as error:
            return _json_response(status_body(400, "BadRequest", str(error)), status=400)

    def _route(self, parts: list[str]) -> tuple[Any, ...]:
        if parts == ["version"]:
            return ("discovery", {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fake", "platform": "linux/amd64"})
        if parts == ["api"]:
            return ("discovery", {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if parts == ["apis"]:
            groups = sorted({r.group for r in RESOURCES if r.group and r.plural not in self._uninstalled})
            versions = {r.group: r.version for r in RESOURCES}
            return (
                "discovery",
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [
                        {
                            "name": g,
                            "versions": [{"groupVersion": f"{g}/{versions[g]}", "version": versions[g]}],
                            "preferredVersion": {"groupVersion": f"{g}/{versions[g]}", "version": versions[g]},
                        }
                        for g in groups
                    ],
                },
            )
        if (parts[:1] == ["api"] and len(parts) == 2) or (parts[:1] == ["apis"] and len(parts) == 3):
            resource_list = api_resource_list("/".join(parts[1:]), frozenset(self._uninstalled))
            if resource_list is not None:
                return ("discovery", resource_list)
        if parts[:2] == ["api", "v1"]:
            api_version, rest = "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = name = subresource = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3 or (namespace is None and len(rest) > 1):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resource = _BY_KEY.get(f"{api_version}/{rest[0]}")
        if resource is None or resource.plural in self._uninstalled:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if len(rest) >= 2:
            name = rest[1]
        if len(rest) == 3:
            subresource = rest[2]
            if subresource != "status" or not resource.status_subresource:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return ("resource", resource, namespace, name, subresource)

    @staticmethod
    def _verb(method: str, route: tuple[Any, ...], query: Mapping[str, str]) -> str:
        if route[0] == "discovery":
            return "get"
        name = route[3]
        if name is None:
            if method == "GET":
                return "watch" if query.get("watch", "").lower() in ("true", "1") else "list"
            if method == "POST" and route[2] is not None:
                return "create"
        else:
            verbs = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
            if method in verbs:
                return verbs[method]
        raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource: {method}")

    @staticmethod
    def _need_json(content_type: str) -> None:
        if content_type not in ("application/json", "application/yaml", ""):
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {content_type})")

    @staticmethod
    async def _body(request: web.Request, optional: bool, content_type: str = "") -> Any:
        raw = await request.read()
        if not raw:
            if optional:
                return None
            raise sem.Invalid("the request body is empty", code=400)
        try:
            if content_type in (PATCH_APPLY, "application/yaml"):
                # An apply body may be YAML; most clients send JSON, which YAML's parser reads ten
                # times slower.
                try:
                    return json.loads(raw)
                except ValueError:
                    return yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as error:
            raise sem.Invalid(f"the request body could not be decoded: {error}", code=400) from error

    # --- reads ------------------------------------------------------------------------------------

    def _get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        obj = self._store[resource.key].get((namespace, name))
        if obj is None:
            raise self._not_found(resource, name)
        return obj

    def _list(self, resource: Resource, namespace: str | None, query: Mapping[str, str]) -> dict[str, Any]:
        token = query.get("continue")
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                snapshot_id, offset = decoded["id"], int(decoded["offset"])
            except (ValueError, KeyError, TypeError) as error:
                raise ApiError(400, "BadRequest", "continue key is not valid") from error
            if snapshot_id not in self._snapshots:
                raise ApiError(410, "Expired", "the provided continue parameter is too old to display a consistent list result; start a new list without it")
            rv, items = self._snapshots[snapshot_id]
        else:
            labels = sem.parse_selector(query.get("labelSelector"))
            fields = sem.parse_selector(query.get("fieldSelector"))
            rv, offset, snapshot_id = self._rv, 0, uuid.uuid4().hex
            items = [
                obj
                for (ns, _), obj in sorted(self._store[resource.key].items())
                if (namespace is None or ns == namespace)
                and sem.selector_matches(labels, obj["metadata"].get("labels") or {})
                and sem.selector_matches(fields, sem.field_selector_values(obj))
            ]
        limit = int(query.get("limit") or 0)
        end = offset + limit if limit > 0 else len(items)
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if end < len(items):
            if snapshot_id not in self._snapshots:
                self._snapshots[snapshot_id] = (rv, items)
                while len(self._snapshots) > self._page_snapshots:
                    self._snapshots.popitem(last=False)
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps({"id": snapshot_id, "offset": end}).encode()).decode()
            metadata["remainingItemCount"] = len(items) - end
        return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version, "metadata": metadata, "items": items[offset:end]}

    # --- writes -----------------------------------------------------------------------------------

    def _http_create(self, resource: Resource, namespace: str, body: Any, manager: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise sem.Invalid("the request body must be an object", code=400)
        self._check_type(resource, body)
        metadata = body.setdefault("metadata", {})
        if metadata.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = metadata["generateName"] + uuid.uuid4().hex[:5]
        return self._create(resource, namespace, body, manager=manager, keep_status=not resource.status_subresource)

    def _create(
        self,
        resource: Resource,
        namespace: str,
        body: dict[str, Any],
        *,
        manager: str,
        keep_status: bool,
        owners: list[sem.Ownership] | None = None,
    ) -> dict[str, Any]:
        metadata = body.setdefault("metadata", {})
        name = metadata.get("name")
        sem.validate_name(name)
        if (namespace, name) in self._store[resource.key]:
            raise ApiError(409, "AlreadyExists", f'{resource.plural}.{resource.group} "{name}" already exists', self._details(resource, name))
        if not keep_status:
            body.pop("status", None)
        body["apiVersion"], body["kind"] = resource.api_version, resource.kind
        self._validate(resource, body)
        metadata.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        for server_field in ("resourceVersion", "managedFields", "deletionTimestamp"):
            metadata.pop(server_field, None)
        if resource.tracks_generation:
            metadata["generation"] = 1
        if owners is None:
            owners = sem.record_update(None, body, [], manager=manager, subresource="", now=_now(), scope=self._main_scope(resource, body))
        return self._commit(resource, None, body, owners, "ADDED", emit=True)

    def _http_replace(self, resource: Resource, namespace: str, name: str, subresource: str | None, body: Any, manager: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise sem.Invalid("the request body must be an object", code=400)
        self._check_type(resource, body)
        metadata = body.get("metadata") or {}
        if metadata.get("name") != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        current = self._get(resource, namespace, name)
        sent_rv = metadata.get("resourceVersion")
        if sent_rv is None and not resource.builtin:
            raise sem.Invalid("metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")
        if sent_rv is not None and sent_rv != current["metadata"]["resourceVersion"]:
            raise self._conflict(resource, name)
        return self._write(resource, current, body, subresource, manager, "update")

    def _http_patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        subresource: str | None,
        body: Any,
        content_type: str,
        query: Mapping[str, str],
        manager: str,
    ) -> tuple[dict[str, Any], bool]:
        if content_type == PATCH_APPLY:
            return self._apply(resource, namespace, name, subresource, body, query)
        current = self._get(resource, namespace, name)
        if content_type == PATCH_MERGE or (content_type == PATCH_STRATEGIC and resource.builtin):
            if not isinstance(body, dict):
                raise sem.Invalid("a merge patch must be an object", code=400)
            patched = sem.merge_patch(current, body)
        elif content_type == PATCH_JSON:
            patched = sem.json_patch(current, body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types include: {PATCH_JSON}, {PATCH_MERGE}, {PATCH_APPLY}")
        self._check_rv_precondition(resource, current, patched)
        return self._write(resource, current, patched, subresource, manager, "patch"), False

    def _apply(self, resource: Resource, namespace: str, name: str, subresource: str | None, body: Any, query: Mapping[str, str]) -> tuple[dict[str, Any], bool]:
        manager = query.get("fieldManager")
        if not manager:
            raise ApiError(400, "BadRequest", "PATCH, application/apply-patch+yaml requests require a fieldManager")
        if not isinstance(body, dict):
            raise sem.Invalid("an apply configuration must be an object", code=400)
        if body.get("apiVersion") != resource.api_version or body.get("kind") != resource.kind:
            raise ApiError(400, "BadRequest", f"apply configuration must set apiVersion {resource.api_version!r} and kind {resource.kind!r}")
        metadata = body.get("metadata") or {}
        if metadata.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        force = query.get("force", "").lower() in ("true", "1")
        current = self._store[resource.key].get((namespace, name))
        created = current is None
        if current is None:
            if subresource == "status":
                raise self._not_found(resource, name)
            current = {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": {"name": name, "namespace": namespace}}
        self._check_rv_precondition(resource, current, body)
        if subresource == "status":
            applied = {"status": body["status"]} if "status" in body else {}
        else:
            applied = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")}
            if resource.status_subresource:
                applied.pop("status", None)
            kept_metadata = {k: metadata[k] for k in ("labels", "annotations") if k in metadata}
            if kept_metadata:
                applied["metadata"] = kept_metadata
        owner_key = (resource.key, namespace, name)
        try:
            merged, owners = sem.apply(
                current,
                applied,
                [] if created else self._owners.get(owner_key, []),
                manager=manager,
                subresource=subresource or "",
                force=force,
                now=_now(),
            )
        except sem.ApplyConflict as error:
            raise ApiError(409, "Conflict", str(error), self._details(resource, name)) from error
        if created:
            merged.setdefault("metadata", {})["name"] = name
            keep_status = not resource.status_subresource
            return self._create(resource, namespace, merged, manager=manager, keep_status=keep_status, owners=owners), True
        return self._commit_checked(resource, current, merged, subresource, owners), False

    def _check_rv_precondition(self, resource: Resource, current: Mapping[str, Any], candidate: Mapping[str, Any]) -> None:
        sent = (candidate.get("metadata") or {}).get("resourceVersion")
        if sent is not None and sent != current["metadata"].get("resourceVersion"):
            raise self._conflict(resource, current["metadata"]["name"])

    def _write(self, resource: Resource, current: dict[str, Any], candidate: dict[str, Any], subresource: str | None, manager: str, operation: str) -> dict[str, Any]:
        new = self._restrict(resource, current, candidate, subresource)
        key = (resource.key, current["metadata"]["namespace"], current["metadata"]["name"])
        scope = ["status"] if subresource == "status" else self._main_scope(resource, new)
        owners = sem.record_update(current, new, self._owners.get(key, []), manager=manager, subresource=subresource or "", now=_now(), scope=scope)
        return self._commit_checked(resource, current, new, subresource, owners)

    @staticmethod
    def _main_scope(resource: Resource, obj: Mapping[str, Any]) -> list[str]:
        return [k for k in obj if k not in ("apiVersion", "kind", "metadata") and not (k == "status" and resource.status_subresource)]

    @staticmethod
    def _restrict(resource: Resource, current: Mapping[str, Any], candidate: Mapping[str, Any], subresource: str | None) -> dict[str, Any]:
        """What an endpoint may change: status alone via /status; all but status via the main resource."""
        if subresource == "status":
            new = copy.deepcopy(dict(current))
            if "status" in candidate:
                new["status"] = copy.deepcopy(candidate["status"])
            else:
                new.pop("status", None)
            return new
        new = copy.deepcopy(dict(candidate))
        if resource.status_subresource:
            new.pop("status", None)
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        return new

    def _commit_checked(self, resource: Resource, current: dict[str, Any], new: dict[str, Any], subresource: str | None, owners: list[sem.Ownership]) -> dict[str, Any]:
        old_meta = current["metadata"]
        meta = new.setdefault("metadata", {})
        if subresource == "status":
            new["metadata"] = meta = copy.deepcopy(old_meta)
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion"):
            if fixed in old_meta:
                meta[fixed] = old_meta[fixed]
            else:
                meta.pop(fixed, None)
        new["apiVersion"], new["kind"] = resource.api_version, resource.kind
        self._validate(resource, new, status_write=subresource == "status" or not resource.status_subresource)
        if resource.tracks_generation and self._spec_of(new, resource) != self._spec_of(current, resource):
            meta["generation"] = old_meta.get("generation", 1) + 1
        return self._commit(resource, current, new, owners, "MODIFIED", emit=True)

    @staticmethod
    def _spec_of(obj: Mapping[str, Any], resource: Resource) -> dict[str, Any]:
        """What moves metadata.generation: all but metadata, and status when it is a subresource."""
        return {k: v for k, v in obj.items() if k != "metadata" and not (k == "status" and resource.status_subresource)}

    def _commit(self, resource: Resource, current: dict[str, Any] | None, new: dict[str, Any], owners: list[sem.Ownership], event: str, *, emit: bool) -> dict[str, Any]:
        meta = new["metadata"]
        meta["managedFields"] = self._render_owners(resource, owners)
        if not meta["managedFields"]:
            del meta["managedFields"]
        if current is not None and new == current:
            return current  # nothing changed: no new version, no event
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        key = (meta["namespace"], meta["name"])
        self._store[resource.key][key] = new
        self._owners[(resource.key, *key)] = owners
        if emit:
            self._emit(resource, event, new)
        return new

    def _render_owners(self, resource: Resource, owners: Iterable[sem.Ownership]) -> list[dict[str, Any]]:
        rendered = []
        for owner in owners:
            entry: dict[str, Any] = {
                "manager": owner.manager,
                "operation": owner.operation,
                "apiVersion": resource.api_version,
                "time": owner.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": sem.fields_v1(owner.paths),
            }
            if owner.subresource:
                entry["subresource"] = owner.subresource
            rendered.append(entry)
        return rendered

    def _replace_whole(self, obj: Mapping[str, Any], *, emit: bool) -> dict[str, Any]:
        resource = self._resource_of(obj)
        metadata = obj.get("metadata", {})
        namespace = metadata.get("namespace", "default")
        current = self._get(resource, namespace, metadata.get("name", ""))
        new = copy.deepcopy(dict(obj))
        new.setdefault("metadata", {})
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "managedFields"):
            if fixed in current["metadata"]:
                new["metadata"][fixed] = current["metadata"][fixed]
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        new["apiVersion"], new["kind"] = resource.api_version, resource.kind
        self._validate(resource, new, status_write=True)
        if resource.tracks_generation and self._spec_of(new, resource) != self._spec_of(current, resource):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        owners = self._owners.get((resource.key, namespace, current["metadata"]["name"]), [])
        return self._commit(resource, current, new, owners, "MODIFIED", emit=emit)

    def _http_delete(self, resource: Resource, namespace: str, name: str, options: Any) -> dict[str, Any]:
        current = self._get(resource, namespace, name)
        preconditions = (options or {}).get("preconditions") or {}
        if "uid" in preconditions and preconditions["uid"] != current["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {current['metadata']['uid']}", self._details(resource, name))
        if "resourceVersion" in preconditions and preconditions["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise self._conflict(resource, name)
        self._delete(resource, namespace, name)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {**self._details(resource, name), "uid": current["metadata"]["uid"]},
        }

    def _delete(self, resource: Resource, namespace: str, name: str) -> None:
        gone = self._store[resource.key].pop((namespace, name))
        self._owners.pop((resource.key, namespace, name), None)
        self._rv += 1
        final = {**gone, "metadata": {**gone["metadata"], "resourceVersion": str(self._rv)}}
        self._emit(resource, "DELETED", final)

    def _emit(self, resource: Resource, event: str, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        # Encoded once for every watcher, as the API server's watch cache does.
        line = pydantic_core.to_json({"type": event, "object": obj}) + b"\n"
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        labels = meta.get("labels") or {}
        self._history.append(_HistoryEntry(self._rv, resource.key, meta["namespace"], meta["name"], labels, line))
        for watcher in self._watchers[resource.key]:
            if watcher.wants(meta["namespace"], meta["name"], labels):
                watcher.queue.put_nowait(line)

    # --- watch ------------------------------------------------------------------------------------

    async def _watch(self, request: web.Request, resource: Resource, namespace: str | None) -> web.StreamResponse:
        query = request.query
        watcher = _Watcher(resource, namespace, sem.parse_selector(query.get("labelSelector")), sem.parse_selector(query.get("fieldSelector")))
        since = query.get("resourceVersion") or "0"
        if not since.isdigit():
            raise sem.Invalid(f"resourceVersion: Invalid value: {since!r}: must be an integer", code=400)
        start = int(since)
        expired = start != 0 and start < self._floor
        if expired and self.expired_watch_as_http:
            raise ApiError(410, "Expired", f"too old resource version: {start} ({self._floor})")
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1") and self.bookmark_interval
        timeout = float(query.get("timeoutSeconds") or 0) or None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if expired:
            gone = status_body(410, "Expired", f"too old resource version: {start} ({self._floor})")
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await response.write_eof()
            return response
        # Replay and registration happen with no await between them, so no event falls in a gap.
        initial_events = query.get("sendInitialEvents", "").lower() == "true"
        if start == 0 or initial_events:
            for (ns, name), obj in sorted(self._store[resource.key].items()):
                if watcher.wants(ns, name, obj["metadata"].get("labels") or {}):
                    watcher.queue.put_nowait(json.dumps({"type": "ADDED", "object": obj}, separators=(",", ":")).encode() + b"\n")
            if initial_events:
                watcher.queue.put_nowait(initial_events_end(resource, self._rv))
        else:
            for entry in self._history:
                if entry.rv > start and entry.resource == resource.key and watcher.wants(entry.namespace, entry.name, entry.labels):
                    watcher.queue.put_nowait(entry.line)
        self._watchers[resource.key].add(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        next_bookmark = loop.time() + self.bookmark_interval if bookmarks else None
        try:
            while True:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                if watcher.queue.empty():
                    # A bookmark goes out only when every event queued before it has: its version
                    # may be past theirs, and a client moves its version to the bookmark's.
                    if next_bookmark is not None and now >= next_bookmark:
                        next_bookmark = now + self.bookmark_interval
                        await response.write(self._bookmark(resource))
                        continue
                    wakeups = [t for t in (deadline, next_bookmark) if t is not None]
                    wait = max(0.0, min(wakeups) - now) if wakeups else None
                    try:
                        item = await asyncio.wait_for(watcher.queue.get(), wait)
                    except TimeoutError:
                        continue
                else:
                    item = watcher.queue.get_nowait()
                # Like the API server's watch handler, which flushes only when no event waits: what
                # queued meanwhile goes out in one write, not a write (and a wakeup of the client)
                # per event.
                batch: list[bytes] = []
                while isinstance(item, bytes):
                    batch.append(item)
                    item = watcher.queue.get_nowait() if not watcher.queue.empty() else None
                if batch:
                    await response.write(b"".join(batch))
                    self.watch_events_sent[resource.key] += len(batch)
                if item is _STOP:
                    break
                if item is _DROP:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._watchers[resource.key].discard(watcher)
        return response

    # --- small helpers ----------------------------------------------------------------------------

    def _bookmark(self, resource: Resource) -> bytes:
        mark = {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": {"resourceVersion": str(self._rv)}}
        return json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"

    def _resource_of(self, obj: Mapping[str, Any]) -> Resource:
        resource = _BY_KIND.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        if resource is None:
            raise KeyError(f"the fake serves no {obj.get('apiVersion')} {obj.get('kind')}")
        return resource

    @staticmethod
    def _check_type(resource: Resource, body: dict[str, Any]) -> None:
        """Fill in a missing apiVersion/kind from the URL (typed clients omit them); refuse a wrong one."""
        for field_name, want in (("apiVersion", resource.api_version), ("kind", resource.kind)):
            if body.get(field_name) in (None, ""):
                body[field_name] = want
            elif body.get(field_name) != want:
                raise ApiError(400, "BadRequest", f"the API version in the data ({body.get('apiVersion')}) / kind ({body.get('kind')}) does not match the expected {resource.api_version} {resource.kind}")

    @staticmethod
    def _validate(resource: Resource, obj: Mapping[str, Any], *, status_write: bool = False) -> None:
        sem.validate_name(obj.get("metadata", {}).get("name"))
        if resource.plural == "httproutes":
            sem.validate_httproute(obj)
        if resource.plural == "trafficmaps" and status_write:
            sem.validate_conditions(obj.get("status"))
        if resource.plural == "regionreports":
            sem.validate_region_report(obj)

    @staticmethod
    def _details(resource: Resource, name: str) -> dict[str, Any]:
        return {"name": name, "group": resource.group, "kind": resource.plural}

    def _not_found(self, resource: Resource, name: str) -> ApiError:
        what = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        return ApiError(404, "NotFound", f'{what} "{name}" not found', self._details(resource, name))

    def _conflict(self, resource: Resource, name: str) -> ApiError:
        what = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {what} "{name}": the object has been modified; please apply your changes to the latest version and try again', self._details(resource, name))


# --- kubectl ---------------------------------------------------------------------------------------

# What `kubectl get` resolves a resource type from (singular names and short names).
_SHORT_NAMES = {"trafficmaps": ["tm"], "inferenceservices": ["isvc"], "services": ["svc"], "regionreports": ["rr"]}
_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def api_resource_list(group_version: str, uninstalled: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The discovery document of one group version (`v1`, `ome.io/v1beta1`), or None when the fake
    serves no resource of it (`uninstalled`: plurals whose CRD is not installed)."""
    served = [r for r in RESOURCES if r.api_version == group_version and r.plural not in uninstalled]
    if not served:
        return None
    resources: list[dict[str, Any]] = []
    for r in served:
        resources.append({
            "name": r.plural,
            "singularName": r.kind.lower(),
            "namespaced": True,
            "kind": r.kind,
            "verbs": _VERBS,
            "shortNames": _SHORT_NAMES.get(r.plural, []),
        })
        if r.status_subresource:
            resources.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": True, "kind": r.kind,
                              "verbs": ["get", "patch", "update"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def _json_response(body: Any, status: int = 200) -> web.Response:
    # pydantic-core encodes a TrafficMap about three times faster than the json module: with ten
    # regions applying their conditions, the fake's answers were a tenth of its CPU.
    return web.Response(body=pydantic_core.to_json(body), status=status, content_type="application/json")


def initial_events_end(resource: Resource, rv: int) -> bytes:
    """The BOOKMARK that ends a watch's initial events (`sendInitialEvents=true`, how kubectl wait
    and client-go's watch-list read the current state); kubectl waits for it before it decides."""
    mark = {
        "kind": resource.kind,
        "apiVersion": resource.api_version,
        "metadata": {"resourceVersion": str(rv), "annotations": {INITIAL_EVENTS_END: "true"}},
    }
    return json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"


def write_kubeconfig(path: Path | str, url: str, *, token: str = "fake-token") -> Path:
    """A kubeconfig pointing at `url` over plain HTTP with a bearer token the fake ignores."""
    target = Path(path)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
        "current-context": "fake",
    }
    target.write_text(yaml.safe_dump(config))
    return target
