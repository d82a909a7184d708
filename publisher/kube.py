"""The one home of kubernetes_asyncio: client setup, list, watch streams, apply, delete, Lease lock.

Owns the HTTP conversation with an API server and the translation of its failures into KubeError
(code, reason, message, from the API's Status body; a kubeconfig that cannot be used is one too).
It knows no TrafficMap semantics, never retries (the caller's edge decides: one Lease attempt per
call), and never imports gate, verify, plan or loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pydantic_core
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
# A request that is not a watch should answer well within this; a slow API server is retried by
# the caller, not waited on forever.
REQUEST_TIMEOUT_SECONDS = 30.0



def decode_json(data: bytes) -> Any:
    """JSON from the API server, by pydantic-core's parser: a third faster than the json module's
    on list pages and watch events, the bulk of the first sync's CPU at 10,000 maps. Raises
    ValueError on text that is not JSON."""
    return pydantic_core.from_json(data)

@dataclass(frozen=True, slots=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [root]
        if namespace is not None and self.namespaced:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
            if subresource is not None:
                parts.append(subresource)
        return "/".join(parts)


TRAFFIC_MAPS = Resource("ome.io", "v1beta1", "trafficmaps", "TrafficMap")
INFERENCE_SERVICES = Resource("ome.io", "v1beta1", "inferenceservices", "InferenceService")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
HTTP_ROUTES = Resource("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute")
SERVICES = Resource("", "v1", "services", "Service")


class KubeError(Exception):
    """A failed API call, as the API server's Status described it (code 0: no answer at all)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    @property
    def gone(self) -> bool:
        return self.code == 410

    @property
    def conflict(self) -> bool:
        return self.code == 409

    @property
    def not_found(self) -> bool:
        return self.code == 404

    @classmethod
    def from_status(cls, code: int, body: bytes | str | dict[str, Any] | None) -> KubeError:
        status: Any = body
        if isinstance(body, (bytes, str)):
            try:
                status = json.loads(body)
            except ValueError:
                status = None
        if isinstance(status, dict):
            return cls(int(status.get("code") or code), str(status.get("reason") or ""), str(status.get("message") or ""))
        text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
        return cls(code, "", text[:500])


def _kubeconfig_file(kubeconfig: str | os.PathLike[str] | None) -> tuple[str, str] | None:
    """(path, how it was chosen) of the kubeconfig to load, or None for the in-cluster config."""
    if kubeconfig is not None:
        return str(kubeconfig), "--kubeconfig"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    from_env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if from_env:
        return from_env, "$KUBECONFIG"
    return str(Path("~/.kube/config").expanduser()), "the default kubeconfig"


async def _configuration(kubeconfig: str | os.PathLike[str] | None) -> k8s_client.Configuration:
    """The client configuration; a KubeError naming the file and the reason when there is none."""
    configuration = k8s_client.Configuration()
    chosen = _kubeconfig_file(kubeconfig)
    if chosen is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except Exception as exc:  # the loader raises whatever a broken mount provokes
            raise KubeError(0, "InvalidConfiguration", f"in-cluster configuration: {_one_line(exc)}") from exc
        return configuration
    path, origin = chosen
    if not Path(path).is_file():
        hint = "" if origin != "the default kubeconfig" else " (not in a cluster, $KUBECONFIG unset: pass --kubeconfig)"
        raise KubeError(0, "InvalidConfiguration", f"{origin} {path}: no such file{hint}")
    try:
        await k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    except Exception as exc:  # YAML, type and key errors as well as ConfigException, by input
        raise KubeError(0, "InvalidConfiguration", f"{origin} {path}: not a usable kubeconfig: {_one_line(exc)}") from exc
    return configuration


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "WS_PROXY", "WSS_PROXY")


class Kube:
    """A connection to one API server. Methods return decoded JSON and raise KubeError."""

    def __init__(self, api_client: k8s_client.ApiClient) -> None:
        self.api_client = api_client

    @classmethod
    async def connect(cls, kubeconfig: str | os.PathLike[str] | None = None) -> Kube:
        """`kubeconfig` when given, else in-cluster, else $KUBECONFIG or ~/.kube/config."""
        configuration = await _configuration(kubeconfig)
        api_client = k8s_client.ApiClient(configuration=configuration)
        if not any(os.environ.get(name) for name in _PROXY_VARIABLES):
            # kubernetes_asyncio's session trusts the environment, which costs two thread hops
            # per request (proxy variables, ~/.netrc): 40% of our CPU in a 10,000-map HTTPRoute
            # publish. With no proxy variable set there is nothing to find but a .netrc.
            session = api_client.rest_client.pool_manager
            if hasattr(session, "_trust_env"):
                session._trust_env = False
        return cls(api_client)


    async def close(self) -> None:
        await self.api_client.close()

    @asynccontextmanager
    async def _response(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | aiohttp.ClientTimeout = REQUEST_TIMEOUT_SECONDS,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The raw response of one call, with auth applied by kubernetes_asyncio; 2xx only.

        Sent on kubernetes_asyncio's own session (its TLS context) with its headers, token
        (refreshed by its hook), proxy and TLS server name, but not through `call_api`: its
        generic serialisation of headers, query and body was most of what a status write cost us
        over a bare aiohttp client (benchmarks/status_floor.py), 10,000 writes at a start."""
        api_client = self.api_client
        rest = api_client.rest_client
        headers = {**api_client.default_headers, "Content-Type": content_type, "Accept": "application/json"}
        if api_client.cookie:
            headers["Cookie"] = api_client.cookie
        params = [(k, str(v)) for k, v in (query or {}).items() if v is not None]
        extra: dict[str, Any] = {}
        if rest.proxy:
            extra["proxy"] = rest.proxy
        if rest.proxy_headers:
            extra["proxy_headers"] = rest.proxy_headers
        if rest.server_hostname:
            extra["server_hostname"] = rest.server_hostname
        try:
            await api_client.update_params_for_auth(headers, params, ["BearerToken"])
            url = api_client.configuration.host + path + ("?" + urlencode(params) if params else "")
            response = await rest.pool_manager.request(
                method,
                url,
                headers=headers,
                data=pydantic_core.to_json(body) if body is not None else None,
                timeout=timeout if isinstance(timeout, aiohttp.ClientTimeout) else aiohttp.ClientTimeout(total=timeout),
                **extra,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise KubeError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc
        try:
            if not 200 <= response.status < 300:
                try:
                    payload = await response.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    payload = b""
                raise KubeError.from_status(response.status, payload)
            yield response
        finally:
            response.release()

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        async with self._response(method, path, query=query, body=body, content_type=content_type) as response:
            try:
                payload = await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise KubeError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc
        try:
            return decode_json(payload) if payload else {}
        except ValueError as exc:
            # A 2xx whose body is not JSON (a proxy's page, a cut connection): no answer at all.
            raise KubeError(0, "InvalidResponse", f"{method} {path}: the answer is not JSON: {payload[:80]!r}") from exc

    async def list(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> dict[str, Any]:
        query = {"labelSelector": label_selector, "limit": limit, "continue": continue_token}
        return await self.request("GET", resource.path(namespace), query=query)

    @asynccontextmanager
    async def watch(
        self,
        resource: Resource,
        *,
        namespace: str | None,
        resource_version: str,
        label_selector: str | None = None,
        timeout_seconds: int = 300,
        silence_timeout: float = 60.0,
    ) -> AsyncIterator[aiohttp.StreamReader]:
        """An open watch stream: newline-delimited JSON events. A read silent for longer than
        `silence_timeout` raises asyncio.TimeoutError (bookmarks keep a healthy watch talking)."""
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
            "labelSelector": label_selector,
        }
        timeout = aiohttp.ClientTimeout(total=None, connect=REQUEST_TIMEOUT_SECONDS, sock_read=silence_timeout)
        async with self._response("GET", resource.path(namespace), query=query, timeout=timeout) as response:
            yield response.content

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        return await self.request("GET", resource.path(namespace, name))

    async def apply(
        self,
        resource: Resource,
        body: dict[str, Any],
        *,
        field_manager: str,
        subresource: str | None = None,
        force: bool = True,
    ) -> dict[str, Any]:
        """Server-side apply of `body` (which carries apiVersion, kind, metadata.name/namespace)."""
        metadata = body["metadata"]
        path = resource.path(metadata.get("namespace"), metadata["name"], subresource)
        query = {"fieldManager": field_manager, "force": "true" if force else None}
        return await self.request("PATCH", path, query=query, body=body, content_type=APPLY_PATCH)

    async def delete(self, resource: Resource, namespace: str, name: str) -> None:
        await self.request("DELETE", resource.path(namespace, name))



def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseLock:
    """One coordination.k8s.io/v1 Lease with client-go's resourcelock semantics, one attempt per
    call (the caller times and retries them). Another holder's lease counts as expired
    `leaseDurationSeconds` after we first saw its current record, by our own clock, so clock skew
    between replicas cannot end a live lease early."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str) -> None:
        self._kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0

    async def try_acquire_or_renew(self, lease_duration: int) -> bool:
        """True when we hold the Lease after this call. Raises KubeError when the API fails."""
        now = datetime.now(UTC)
        try:
            lease = await self._kube.get(LEASES, self.namespace, self.name)
        except KubeError as exc:
            if not exc.not_found:
                raise
            return await self._create(lease_duration, now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        duration = spec.get("leaseDurationSeconds") or lease_duration
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            return False
        ours = holder == self.identity
        lease["spec"] = {
            **spec,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": lease_duration,
            "renewTime": _micro_time(now),
            "acquireTime": spec.get("acquireTime") if ours and spec.get("acquireTime") else _micro_time(now),
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
        }
        return await self._replace(lease)

    async def release(self) -> None:
        """Give the Lease up if we hold it, so a successor need not wait for it to expire."""
        lease = await self._kube.get(LEASES, self.namespace, self.name)
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return
        now = _micro_time(datetime.now(UTC))
        lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now, "acquireTime": now}
        await self._replace(lease)

    async def _create(self, lease_duration: int, now: datetime) -> bool:
        body = {
            "apiVersion": LEASES.api_version,
            "kind": LEASES.kind,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": lease_duration,
                "acquireTime": _micro_time(now),
                "renewTime": _micro_time(now),
                "leaseTransitions": 0,
            },
        }
        try:
            await self._kube.request("POST", LEASES.path(self.namespace), body=body)
        except KubeError as exc:
            if exc.conflict:  # AlreadyExists: another replica created it first
                return False
            raise
        return True

    async def _replace(self, lease: dict[str, Any]) -> bool:
        """PUT with the resourceVersion we read: a 409 means someone else wrote it first."""
        try:
            await self._kube.request("PUT", LEASES.path(self.namespace, self.name), body=lease)
        except KubeError as exc:
            if exc.conflict:
                return False
            raise
        return True
