"""Each promise of tests/fakes/kube_api.py, checked over real HTTP against the Kubernetes API's
documented behaviour (API concepts: list/watch/resourceVersion/bookmarks; server-side apply;
metav1.Condition; the status subresource), plus one end-to-end run of kubernetes_asyncio."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.fakes.kube_api import PATCH_APPLY, PATCH_JSON, PATCH_MERGE, PATCH_STRATEGIC, FakeKubeAPI
from tests.gateways import eventually

TM = "/apis/ome.io/v1beta1"
TM_RESOURCE = "ome.io/v1beta1/trafficmaps"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
ROUTES = "/apis/gateway.networking.k8s.io/v1/namespaces/default/httproutes"


def make_map(name: str = "llama", namespace: str = "default", *, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        metadata["labels"] = labels
    return {
        "apiVersion": "ome.io/v1beta1",
        "kind": "TrafficMap",
        "metadata": metadata,
        "spec": {"service": name, "mode": "Split", "observedISVCGeneration": 1, "entries": [], **spec},
    }


def condition(type_: str = "Routable", **overrides: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True",
        "reason": "Routable",
        "message": "",
        "observedGeneration": 1,
        "lastTransitionTime": "2025-01-02T03:04:05Z",
        **overrides,
    }


def status_apply(name: str, *conditions: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "ome.io/v1beta1",
        "kind": "TrafficMap",
        "metadata": {"name": name, "namespace": "default"},
        "status": {"conditions": list(conditions)},
    }


def map_path(name: str = "llama", suffix: str = "") -> str:
    return f"{TM}/namespaces/default/trafficmaps/{name}{suffix}"


@pytest.fixture
async def http(kube_api: FakeKubeAPI) -> AsyncIterator[aiohttp.ClientSession]:  # noqa: F811
    async with aiohttp.ClientSession(base_url=kube_api.url, timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def call(http: aiohttp.ClientSession, method: str, path: str, body: Any = None, *, content_type: str = "application/json", **params: str) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body)
    headers = {"Content-Type": content_type} if body is not None else {}
    async with http.request(method, path, data=data, headers=headers, params=params) as response:
        return response.status, await response.json(content_type=None)


async def apply_status(http: aiohttp.ClientSession, manager: str, body: dict[str, Any], **params: str) -> tuple[int, dict[str, Any]]:
    return await call(http, "PATCH", map_path(body["metadata"]["name"], "/status"), body, content_type=PATCH_APPLY, fieldManager=manager, **params)


def conditions_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def assert_status(body: dict[str, Any], code: int, reason: str) -> None:
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure", body
    assert (body["code"], body["reason"]) == (code, reason), body
    assert body["message"]


class Stream:
    """A watch connection read line by line, with a bound on every read."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self) -> dict[str, Any] | None:
        async with asyncio.timeout(5):
            line = await self.response.content.readline()
        return json.loads(line) if line else None

    async def take(self, n: int) -> list[dict[str, Any]]:
        return [await self.next() for _ in range(n)]  # type: ignore[misc]


async def open_watch(http: aiohttp.ClientSession, path: str, **params: str) -> aiohttp.ClientResponse:
    return await http.get(path, params={"watch": "true", **params})


# --- 1. lists ------------------------------------------------------------------------------------


async def test_list_namespaced_and_across_namespaces(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a", "one"))
    kube_api.create(make_map("b", "two"))
    code, everything = await call(http, "GET", f"{TM}/trafficmaps")
    assert code == 200
    assert everything["kind"] == "TrafficMapList" and everything["apiVersion"] == "ome.io/v1beta1"
    assert everything["metadata"]["resourceVersion"] == kube_api.resource_version
    assert [i["metadata"]["name"] for i in everything["items"]] == ["a", "b"]
    _, one = await call(http, "GET", f"{TM}/namespaces/one/trafficmaps")
    assert [i["metadata"]["name"] for i in one["items"]] == ["a"]


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("app=a", ["a"]),
        ("app==a", ["a"]),
        ("app!=a", ["b", "c"]),
        ("app in (a,b)", ["a", "b"]),
        ("app notin (a)", ["b", "c"]),
        ("tier", ["a"]),
        ("!tier", ["b", "c"]),
        ("app=a,tier=front", ["a"]),
        ("app=b,tier=front", []),
    ],
    ids=["equals", "double-equals", "not-equals", "in", "notin", "exists", "not-exists", "and", "and-none"],
)
async def test_list_label_selector(kube_api: FakeKubeAPI, http: aiohttp.ClientSession, selector: str, names: list[str]) -> None:  # noqa: F811
    kube_api.create(make_map("a", labels={"app": "a", "tier": "front"}))
    kube_api.create(make_map("b", labels={"app": "b"}))
    kube_api.create(make_map("c"))
    _, listed = await call(http, "GET", f"{TM}/trafficmaps", labelSelector=selector)
    assert [i["metadata"]["name"] for i in listed["items"]] == names


# Each refused by the real kube-apiserver (apimachinery's labels.Parse and its key and value checks).
MALFORMED_SELECTORS = ["app in a", "tier=prod!", "a=b=c", "app,", "-bad=x", "app=-x", "Example.com/app=x",
                       "app in (a b)", "a/b/c=x", "x>a", "!a=b", "app=" + "v" * 64]


@pytest.mark.parametrize("selector", MALFORMED_SELECTORS)
async def test_list_bad_label_selector_is_bad_request(http: aiohttp.ClientSession, selector: str) -> None:
    code, body = await call(http, "GET", f"{TM}/trafficmaps", labelSelector=selector)
    assert code == 400
    assert_status(body, 400, "BadRequest")


@pytest.mark.parametrize("selector", MALFORMED_SELECTORS[:6])
async def test_watch_bad_label_selector_is_bad_request(http: aiohttp.ClientSession, selector: str) -> None:
    async with http.get(f"{TM}/trafficmaps", params={"watch": "1", "labelSelector": selector}) as response:
        assert response.status == 400
        assert_status(await response.json(), 400, "BadRequest")


@pytest.mark.parametrize(
    ("selector", "names"),
    [("n>3", ["b"]), ("n<3", ["a"]), ("app notin (x,), n", ["a", "b"]), ("example.com/team=x", []), ("  ", ["a", "b", "c"])],
    ids=["gt", "lt", "empty-set", "prefixed-key", "blank"],
)
async def test_list_label_selector_as_the_server_reads_it(kube_api: FakeKubeAPI, http: aiohttp.ClientSession, selector: str, names: list[str]) -> None:  # noqa: F811
    kube_api.create(make_map("a", labels={"n": "2"}))
    kube_api.create(make_map("b", labels={"n": "10"}))
    kube_api.create(make_map("c", labels={"app": "x"}))
    code, listed = await call(http, "GET", f"{TM}/trafficmaps", labelSelector=selector)
    assert code == 200, listed
    assert [i["metadata"]["name"] for i in listed["items"]] == names


async def test_list_field_selector_on_name(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    kube_api.create(make_map("b"))
    _, listed = await call(http, "GET", f"{TM}/trafficmaps", fieldSelector="metadata.name=b")
    assert [i["metadata"]["name"] for i in listed["items"]] == ["b"]


async def test_list_pages_are_one_snapshot(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    for name in "abcde":
        kube_api.create(make_map(name))
    _, first = await call(http, "GET", f"{TM}/trafficmaps", limit="2")
    version = first["metadata"]["resourceVersion"]
    assert first["metadata"]["remainingItemCount"] == 3
    kube_api.delete(TM_RESOURCE, "default", "e")
    kube_api.create(make_map("f"))
    names = [i["metadata"]["name"] for i in first["items"]]
    token = first["metadata"]["continue"]
    while token:
        _, page = await call(http, "GET", f"{TM}/trafficmaps", limit="2", **{"continue": token})
        assert page["metadata"]["resourceVersion"] == version
        names += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue")
    assert names == ["a", "b", "c", "d", "e"]
    _, fresh = await call(http, "GET", f"{TM}/trafficmaps")
    assert [i["metadata"]["name"] for i in fresh["items"]] == ["a", "b", "c", "d", "f"]


async def test_list_continue_after_expiry_is_gone(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    for name in "abc":
        kube_api.create(make_map(name))
    _, first = await call(http, "GET", f"{TM}/trafficmaps", limit="1")
    kube_api.expire_history()
    code, body = await call(http, "GET", f"{TM}/trafficmaps", limit="1", **{"continue": first["metadata"]["continue"]})
    assert code == 410
    assert_status(body, 410, "Expired")


# --- 2. single objects ---------------------------------------------------------------------------


async def test_get_missing_is_not_found_status(http: aiohttp.ClientSession) -> None:
    code, body = await call(http, "GET", map_path("nope"))
    assert code == 404
    assert_status(body, 404, "NotFound")
    assert body["details"]["name"] == "nope"


async def test_create_then_get_then_duplicate_is_already_exists(http: aiohttp.ClientSession) -> None:
    code, created = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", make_map())
    assert code == 201
    code, got = await call(http, "GET", map_path())
    assert code == 200 and got == created
    code, body = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", make_map())
    assert code == 409
    assert_status(body, 409, "AlreadyExists")


async def test_create_rejects_bad_name_and_wrong_kind(http: aiohttp.ClientSession) -> None:
    code, body = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", make_map("Not_A_Name"))
    assert code == 422
    assert_status(body, 422, "Invalid")
    wrong = {**make_map(), "kind": "InferenceService"}
    code, body = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", wrong)
    assert code == 400
    assert_status(body, 400, "BadRequest")


async def test_replace_needs_the_current_resource_version(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    stored = kube_api.create(make_map())
    stale = {**stored, "spec": {**stored["spec"], "mode": "All"}}
    kube_api.update({**stored, "spec": {**stored["spec"], "mode": "Single"}})
    code, body = await call(http, "PUT", map_path(), stale)
    assert code == 409
    assert_status(body, 409, "Conflict")
    current = kube_api.get(TM_RESOURCE, "default", "llama")
    assert current is not None
    code, replaced = await call(http, "PUT", map_path(), {**current, "spec": {**current["spec"], "mode": "All"}})
    assert code == 200 and replaced["spec"]["mode"] == "All"
    assert int(replaced["metadata"]["resourceVersion"]) > int(current["metadata"]["resourceVersion"])


async def test_replace_of_a_crd_without_resource_version_is_invalid(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    code, body = await call(http, "PUT", map_path(), make_map(mode="All"))
    assert code == 422
    assert_status(body, 422, "Invalid")


async def test_delete_answers_success_and_then_not_found(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    code, body = await call(http, "DELETE", map_path())
    assert code == 200 and body["kind"] == "Status" and body["status"] == "Success"
    assert kube_api.get(TM_RESOURCE, "default", "llama") is None
    code, body = await call(http, "DELETE", map_path())
    assert code == 404
    assert_status(body, 404, "NotFound")


async def test_delete_with_stale_precondition_is_conflict(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    stored = kube_api.create(make_map())
    kube_api.update({**stored, "spec": {**stored["spec"], "mode": "All"}})
    options = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"resourceVersion": stored["metadata"]["resourceVersion"]}}
    code, body = await call(http, "DELETE", map_path(), options)
    assert code == 409
    assert_status(body, 409, "Conflict")


# --- 3. versions, uid, generation ------------------------------------------------------------------


async def test_one_counter_for_every_write_and_create_metadata(http: aiohttp.ClientSession) -> None:
    _, created = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", make_map())
    service = {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}}
    _, svc = await call(http, "POST", "/api/v1/namespaces/default/services", service)
    first, second = created["metadata"]["resourceVersion"], svc["metadata"]["resourceVersion"]
    assert first.isdigit() and second.isdigit() and int(second) > int(first)
    assert svc["kind"] == "Service" and svc["apiVersion"] == "v1"
    assert created["metadata"]["uid"] and created["metadata"]["uid"] != svc["metadata"]["uid"]
    assert created["metadata"]["creationTimestamp"].endswith("Z")
    assert created["metadata"]["generation"] == 1


async def test_generation_follows_spec_only(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    _, labelled = await call(http, "PATCH", map_path(), {"metadata": {"labels": {"x": "y"}}}, content_type=PATCH_MERGE)
    assert labelled["metadata"]["generation"] == 1
    _, with_status = await apply_status(http, "ome", status_apply("llama", condition()))
    assert with_status["metadata"]["generation"] == 1
    assert int(with_status["metadata"]["resourceVersion"]) > int(labelled["metadata"]["resourceVersion"])
    _, respecced = await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}}, content_type=PATCH_MERGE)
    assert respecced["metadata"]["generation"] == 2


async def test_a_write_that_changes_nothing_keeps_the_version(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    _, once = await apply_status(http, "me", status_apply("llama", condition()))
    _, twice = await apply_status(http, "me", status_apply("llama", condition()))
    assert twice["metadata"]["resourceVersion"] == once["metadata"]["resourceVersion"]
    _, patched = await call(http, "PATCH", map_path(), {"spec": {"mode": "Split"}}, content_type=PATCH_MERGE)
    assert patched["metadata"]["resourceVersion"] == once["metadata"]["resourceVersion"]


# --- 4. status subresource -----------------------------------------------------------------------


async def test_status_endpoint_changes_only_status(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    stored = kube_api.create(make_map())
    body = {**stored, "spec": {**stored["spec"], "mode": "All"}, "status": {"sourceUID": "u1"}}
    code, written = await call(http, "PUT", map_path(suffix="/status"), body)
    assert code == 200
    assert written["status"] == {"sourceUID": "u1"} and written["spec"]["mode"] == "Split"
    _, merged = await call(http, "PATCH", map_path(suffix="/status"), {"spec": {"mode": "All"}, "status": {"sourceUID": "u2"}}, content_type=PATCH_MERGE)
    assert merged["status"] == {"sourceUID": "u2"} and merged["spec"]["mode"] == "Split"


async def test_main_resource_ignores_status(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    code, created = await call(http, "POST", f"{TM}/namespaces/default/trafficmaps", {**make_map(), "status": {"sourceUID": "x"}})
    assert code == 201 and "status" not in created
    kube_api.update({**created, "status": {"sourceUID": "kept"}})
    _, patched = await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}, "status": {"sourceUID": "lost"}}, content_type=PATCH_MERGE)
    assert patched["status"] == {"sourceUID": "kept"} and patched["spec"]["mode"] == "All"


# --- 5. patches and server-side apply --------------------------------------------------------------


async def test_merge_patch_follows_rfc_7386(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map(labels={"a": "1", "b": "2"}))
    _, patched = await call(http, "PATCH", map_path(), {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"entries": [{"cluster": "x"}]}}, content_type=PATCH_MERGE)
    assert patched["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert patched["spec"]["entries"] == [{"cluster": "x"}]


async def test_json_patch_follows_rfc_6902(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    ops = [{"op": "test", "path": "/spec/mode", "value": "Split"}, {"op": "replace", "path": "/spec/mode", "value": "All"}, {"op": "add", "path": "/spec/entries/-", "value": {"cluster": "x"}}]
    code, patched = await call(http, "PATCH", map_path(), ops, content_type=PATCH_JSON)
    assert code == 200 and patched["spec"]["mode"] == "All" and patched["spec"]["entries"] == [{"cluster": "x"}]
    code, body = await call(http, "PATCH", map_path(), [{"op": "test", "path": "/spec/mode", "value": "Split"}], content_type=PATCH_JSON)
    assert code == 422
    assert_status(body, 422, "Invalid")


@pytest.mark.parametrize("content_type", [PATCH_STRATEGIC, "text/plain"], ids=["strategic-on-crd", "unknown"])
async def test_unsupported_patch_type_is_415(kube_api: FakeKubeAPI, http: aiohttp.ClientSession, content_type: str) -> None:  # noqa: F811
    kube_api.create(make_map())
    code, body = await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}}, content_type=content_type)
    assert code == 415
    assert_status(body, 415, "UnsupportedMediaType")


async def test_apply_needs_a_field_manager(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    code, body = await call(http, "PATCH", map_path(suffix="/status"), status_apply("llama", condition()), content_type=PATCH_APPLY)
    assert code == 400
    assert_status(body, 400, "BadRequest")


async def test_apply_accepts_yaml(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    text = "apiVersion: ome.io/v1beta1\nkind: TrafficMap\nmetadata:\n  name: llama\nspec:\n  mode: All\n"
    async with http.patch(map_path(), data=text, headers={"Content-Type": PATCH_APPLY}, params={"fieldManager": "yaml"}) as response:
        assert response.status == 200
        assert (await response.json())["spec"]["mode"] == "All"


async def test_apply_creates_a_missing_object_but_not_its_status(http: aiohttp.ClientSession) -> None:
    code, body = await apply_status(http, "me", status_apply("ghost", condition()))
    assert code == 404
    assert_status(body, 404, "NotFound")
    code, created = await call(http, "PATCH", map_path("fresh"), make_map("fresh"), content_type=PATCH_APPLY, fieldManager="me")
    assert code == 201 and created["metadata"]["generation"] == 1 and created["metadata"]["uid"]
    assert [(m["manager"], m["operation"]) for m in created["metadata"]["managedFields"]] == [("me", "Apply")]


async def test_apply_merges_conditions_by_type_per_manager(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    await apply_status(http, "ome-trafficmap-routing", status_apply("llama", condition("Routable"), condition("CapacityFallback", status="False", reason="None")))
    await apply_status(http, "ome-gateway-publisher-eu", status_apply("llama", condition("gateway-publisher.ome.io/eu", reason="Published")))
    # Re-applying one condition replaces it and leaves the other manager's alone.
    _, after = await apply_status(http, "ome-gateway-publisher-eu", status_apply("llama", condition("gateway-publisher.ome.io/eu", status="False", reason="ApplyFailed")))
    got = conditions_of(after)
    assert set(got) == {"Routable", "CapacityFallback", "gateway-publisher.ome.io/eu"}
    assert got["gateway-publisher.ome.io/eu"]["reason"] == "ApplyFailed"
    # A condition the manager applied before and omits now is removed; other managers' stay.
    _, after = await apply_status(http, "ome-trafficmap-routing", status_apply("llama", condition("Routable", reason="Routable")))
    assert set(conditions_of(after)) == {"Routable", "gateway-publisher.ome.io/eu"}
    entries = {(m["manager"], m["operation"], m.get("subresource")) for m in after["metadata"]["managedFields"]}
    assert entries == {("ome-trafficmap-routing", "Apply", "status"), ("ome-gateway-publisher-eu", "Apply", "status")}
    owned = next(m for m in after["metadata"]["managedFields"] if m["manager"] == "ome-gateway-publisher-eu")
    assert 'k:{"type":"gateway-publisher.ome.io/eu"}' in owned["fieldsV1"]["f:status"]["f:conditions"]


async def test_apply_keeps_a_condition_another_manager_also_owns(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    await apply_status(http, "first", status_apply("llama", condition("Shared")))
    await apply_status(http, "second", status_apply("llama", condition("Shared")))
    _, after = await apply_status(http, "first", status_apply("llama", condition("Other")))
    assert set(conditions_of(after)) == {"Shared", "Other"}


async def test_apply_conflict_needs_force(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    await apply_status(http, "first", status_apply("llama", condition("Routable", reason="Routable")))
    changed = status_apply("llama", condition("Routable", reason="NotPlaced", status="False"))
    code, body = await apply_status(http, "second", changed)
    assert code == 409
    assert_status(body, 409, "Conflict")
    assert "first" in body["message"]
    code, forced = await apply_status(http, "second", changed, force="true")
    assert code == 200 and conditions_of(forced)["Routable"]["reason"] == "NotPlaced"


async def test_a_non_apply_write_takes_ownership_of_what_it_changed(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}}, content_type=PATCH_MERGE, fieldManager="editor")
    code, body = await call(http, "PATCH", map_path(), {**make_map(), "spec": {"mode": "Single"}}, content_type=PATCH_APPLY, fieldManager="applier")
    assert code == 409 and "editor" in body["message"]


# --- 6. validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"type": None},
        {"type": "bad type!"},
        {"type": "x" * 317},
        {"status": "Maybe"},
        {"reason": None},
        {"reason": ""},
        {"reason": "has space"},
        {"reason": "1starts-with-digit"},
        {"reason": "R" * 1025},
        {"message": None},
        {"message": "m" * 32769},
        {"lastTransitionTime": None},
        {"lastTransitionTime": "2025-01-02T03:04:05"},
        {"lastTransitionTime": "yesterday"},
        {"observedGeneration": -1},
    ],
    ids=["type-missing", "type-pattern", "type-long", "status-enum", "reason-missing", "reason-empty", "reason-space", "reason-digit", "reason-long", "message-missing", "message-long", "time-missing", "time-no-zone", "time-text", "generation-negative"],
)
async def test_invalid_condition_is_rejected(kube_api: FakeKubeAPI, http: aiohttp.ClientSession, bad: dict[str, Any]) -> None:  # noqa: F811
    kube_api.create(make_map())
    broken = {k: v for k, v in {**condition(), **bad}.items() if v is not None}
    code, body = await apply_status(http, "me", status_apply("llama", broken))
    assert code == 422
    assert_status(body, 422, "Invalid")
    code, _ = await call(http, "PATCH", map_path(suffix="/status"), {"status": {"conditions": [broken]}}, content_type=PATCH_MERGE)
    assert code == 422


async def test_valid_conditions_are_accepted(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    good = [
        condition("gateway-publisher.ome.io/eu-west", reason="Published", lastTransitionTime="2025-01-02T03:04:05.123+02:00"),
        condition("Routable", reason="A_b:c,d", observedGeneration=0),
    ]
    code, _ = await apply_status(http, "me", status_apply("llama", *good))
    assert code == 200


async def test_duplicate_condition_types_are_rejected(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    code, body = await call(http, "PATCH", map_path(suffix="/status"), {"status": {"conditions": [condition(), condition()]}}, content_type=PATCH_MERGE)
    assert code == 422
    assert_status(body, 422, "Invalid")


def make_route(name: str = "llama", *, hostnames: list[str] | None = None, refs: list[dict[str, Any]] | None = None, rules: int = 1) -> dict[str, Any]:
    refs = refs if refs is not None else [{"name": "svc", "port": 80, "weight": 1}]
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name},
        "spec": {"hostnames": hostnames or ["llama.example.com"], "rules": [{"backendRefs": refs}] * rules},
    }


@pytest.mark.parametrize(
    "route",
    [
        make_route(refs=[{"name": "svc", "weight": 1_000_001}]),
        make_route(refs=[{"name": "svc", "weight": -1}]),
        make_route(refs=[{"name": f"s{i}", "weight": 1} for i in range(17)]),
        make_route(hostnames=["Bad_Host"]),
        make_route(hostnames=["a..b"]),
        make_route(rules=17),
        make_route(name="x" * 254),
    ],
    ids=["weight-high", "weight-negative", "17-backends", "hostname-chars", "hostname-empty-label", "17-rules", "name-long"],
)
async def test_invalid_httproute_is_rejected(http: aiohttp.ClientSession, route: dict[str, Any]) -> None:
    code, body = await call(http, "POST", ROUTES, route)
    assert code == 422
    assert_status(body, 422, "Invalid")


async def test_valid_httproute_is_accepted(http: aiohttp.ClientSession) -> None:
    refs = [{"name": f"s{i}", "weight": w} for i, w in enumerate([0, 1_000_000] + [1] * 14)]
    code, _ = await call(http, "POST", ROUTES, make_route(hostnames=["*.example.com", "llama.example.com"], refs=refs, rules=16))
    assert code == 201


# --- 7. watch ------------------------------------------------------------------------------------


async def test_watch_without_version_starts_with_added_then_follows(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    kube_api.create(make_map("b"))
    async with await open_watch(http, f"{TM}/trafficmaps") as response:
        stream = Stream(response)
        first = await stream.take(2)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in first] == [("ADDED", "a"), ("ADDED", "b")]
        stored = kube_api.get(TM_RESOURCE, "default", "a")
        assert stored is not None
        kube_api.update({**stored, "spec": {**stored["spec"], "mode": "All"}})
        kube_api.delete(TM_RESOURCE, "default", "b")
        events = await stream.take(2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "a"), ("DELETED", "b")]
    assert events[0]["object"]["spec"]["mode"] == "All"
    assert int(events[1]["object"]["metadata"]["resourceVersion"]) > int(events[0]["object"]["metadata"]["resourceVersion"])


async def test_watch_from_a_version_replays_what_came_after(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    _, listed = await call(http, "GET", f"{TM}/trafficmaps")
    kube_api.create(make_map("b"))
    kube_api.create(make_map("c", "elsewhere"))
    async with await open_watch(http, f"{TM}/namespaces/default/trafficmaps", resourceVersion=listed["metadata"]["resourceVersion"]) as response:
        event = await Stream(response).next()
    assert event is not None and (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "b")


async def test_watch_accepts_1_and_filters_by_label(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    async with http.get(f"{TM}/trafficmaps", params={"watch": "1", "labelSelector": "app=a"}) as response:
        stream = Stream(response)
        await eventually(lambda: kube_api.watcher_count() == 1)
        kube_api.create(make_map("other", labels={"app": "b"}))
        kube_api.create(make_map("mine", labels={"app": "a"}))
        event = await stream.next()
    assert event is not None and event["object"]["metadata"]["name"] == "mine"


async def test_watch_fan_out_is_counted_per_resource(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """What the fan-out benchmark reads: watches open now, and events written to all of them."""
    async with await open_watch(http, f"{TM}/trafficmaps") as first, await open_watch(http, f"{TM}/trafficmaps") as second:
        await eventually(lambda: kube_api.watchers_open() == {TM_RESOURCE: 2})
        kube_api.create(make_map("a"))
        for response in (first, second):
            assert await Stream(response).next() is not None
        await eventually(lambda: kube_api.watch_events_sent[TM_RESOURCE] == 2)
    assert kube_api.watch_events_sent == {TM_RESOURCE: 2}


async def test_watch_ends_after_timeout_seconds(http: aiohttp.ClientSession) -> None:
    async with await open_watch(http, f"{TM}/trafficmaps", timeoutSeconds="1") as response:
        assert await Stream(response).next() is None


async def test_watch_sends_bookmarks_with_only_a_version(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=kube_api.resource_version, allowWatchBookmarks="true") as response:
        event = await Stream(response).next()
    assert event is not None and event["type"] == "BOOKMARK"
    assert event["object"]["metadata"] == {"resourceVersion": kube_api.resource_version}


async def test_watch_bookmark_never_overtakes_queued_events(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    # A bookmark carries the store's newest version; sent while older events still wait in the
    # watch's queue, it moves a client past them (a real API server orders bookmarks in the stream).
    kube_api.bookmark_interval = 0.002
    since = kube_api.resource_version
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=since, allowWatchBookmarks="true") as response:
        stream = Stream(response)
        await eventually(lambda: kube_api.watcher_count() == 1)
        names = [f"m-{i}" for i in range(1500)]
        for name in names:  # all queued before the watch writes any: a burst
            kube_api.create(make_map(name))
        added, newest = [], int(since)
        while len(added) < len(names):
            event = await stream.next()
            assert event is not None
            version = int(event["object"]["metadata"]["resourceVersion"])
            if event["type"] == "BOOKMARK":
                assert version >= newest
            else:
                assert version > newest, f"{event['object']['metadata']['name']} at {version} came after a bookmark at {newest}"
                added.append(event["object"]["metadata"]["name"])
            newest = version
        after = await stream.next()  # the bookmarks go on once the burst is out, at the newest version
    assert added == names
    assert after is not None and after["type"] == "BOOKMARK" and int(after["object"]["metadata"]["resourceVersion"]) == newest


async def test_watch_from_an_expired_version_gets_an_error_event(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    old = kube_api.resource_version
    kube_api.create(make_map("b"))
    kube_api.expire_history()
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=old) as response:
        assert response.status == 200
        stream = Stream(response)
        event = await stream.next()
        assert await stream.next() is None
    assert event is not None and event["type"] == "ERROR"
    assert_status(event["object"], 410, "Expired")


async def test_watch_history_is_bounded() -> None:
    async with FakeKubeAPI(history_size=2) as api, aiohttp.ClientSession(base_url=api.url) as http:
        api.create(make_map("a"))
        old = api.resource_version
        for name in "bcd":
            api.create(make_map(name))
        async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=old) as response:
            event = await Stream(response).next()
        assert event is not None and event["object"]["code"] == 410


async def test_expired_watch_as_http_status(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    old = kube_api.resource_version
    kube_api.create(make_map("b"))
    kube_api.expire_history()
    kube_api.expired_watch_as_http = True
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=old) as response:
        assert response.status == 410
        assert_status(await response.json(), 410, "Expired")


# --- 8. fault knobs ------------------------------------------------------------------------------


async def test_drop_watches_cuts_the_stream(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    async with await open_watch(http, f"{TM}/trafficmaps") as response:
        await eventually(lambda: kube_api.watcher_count() == 1)
        kube_api.drop_watches()
        with pytest.raises(aiohttp.ClientPayloadError):
            await Stream(response).next()
    await eventually(lambda: kube_api.watcher_count() == 0)


async def test_change_silently_sends_no_event(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    stored = kube_api.create(make_map("a"))
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=kube_api.resource_version) as response:
        stream = Stream(response)
        await eventually(lambda: kube_api.watcher_count() == 1)
        kube_api.change_silently({**stored, "spec": {**stored["spec"], "mode": "All"}})
        kube_api.create(make_map("b"))
        event = await stream.next()
    assert event is not None and event["object"]["metadata"]["name"] == "b"
    _, got = await call(http, "GET", map_path("a"))
    assert got["spec"]["mode"] == "All"


async def test_fail_next_answers_the_status_then_recovers(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    kube_api.fail_next(1, status=503, verb="patch")
    code, _ = await call(http, "GET", map_path())
    assert code == 200
    code, body = await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}}, content_type=PATCH_MERGE)
    assert code == 503
    assert_status(body, 503, "ServiceUnavailable")
    code, _ = await call(http, "PATCH", map_path(), {"spec": {"mode": "All"}}, content_type=PATCH_MERGE)
    assert code == 200


async def test_refuse_403_is_an_rbac_denial_of_one_verb_and_resource(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    kube_api.refuse(403, verb="list", resource="trafficmaps")
    code, body = await call(http, "GET", f"{TM}/trafficmaps")
    assert code == 403
    assert_status(body, 403, "Forbidden")
    assert body["message"] == (
        'trafficmaps.ome.io is forbidden: User "system:serviceaccount:default:ome-gateway-publisher" cannot list '
        'resource "trafficmaps" in API group "ome.io" at the cluster scope'
    )
    assert body["details"] == {"group": "ome.io", "kind": "trafficmaps"}
    code, body = await call(http, "GET", f"{TM}/namespaces/default/trafficmaps")
    assert code == 403 and body["message"].endswith('in the namespace "default"')
    assert (await call(http, "GET", map_path()))[0] == 200  # get is another verb
    assert (await call(http, "GET", f"{TM}/inferenceservices"))[0] == 200
    kube_api.allow()
    assert (await call(http, "GET", f"{TM}/trafficmaps"))[0] == 200


async def test_refuse_401_answers_every_request_until_allowed(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.refuse(401)
    for method, path in (("GET", f"{TM}/trafficmaps"), ("GET", f"{LEASES}/x"), ("POST", f"{LEASES}")):
        code, body = await call(http, method, path, {} if method == "POST" else None)
        assert code == 401
        assert_status(body, 401, "Unauthorized")
    async with await open_watch(http, f"{TM}/trafficmaps") as response:
        assert response.status == 401
    kube_api.allow()
    assert (await call(http, "GET", f"{TM}/trafficmaps"))[0] == 200


async def test_go_down_refuses_connections_and_come_back_keeps_the_store(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    version = kube_api.resource_version
    url = kube_api.url
    async with await open_watch(http, f"{TM}/trafficmaps", resourceVersion=version) as response:
        await eventually(lambda: kube_api.watcher_count() == 1)
        await kube_api.go_down()
        with pytest.raises(aiohttp.ClientPayloadError):
            await Stream(response).next()
    with pytest.raises(aiohttp.ClientConnectorError):
        await call(http, "GET", map_path())
    await kube_api.come_back()
    assert kube_api.url == url
    code, body = await call(http, "GET", map_path())
    assert code == 200 and body["metadata"]["resourceVersion"] == version
    await kube_api.restart()
    assert (await call(http, "GET", map_path()))[0] == 200


async def test_an_uninstalled_crd_deletes_its_objects_and_answers_404_until_installed(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    reports = "/apis/gateway-publisher.ome.io/v1alpha1"
    report = {"apiVersion": "gateway-publisher.ome.io/v1alpha1", "kind": "RegionReport",
              "metadata": {"name": "eu-0", "namespace": "default"}, "region": "eu", "maps": {}}
    assert (await call(http, "POST", f"{reports}/namespaces/default/regionreports", report))[0] == 201
    kube_api.uninstall("regionreports")
    assert kube_api.objects("gateway-publisher.ome.io/v1alpha1/regionreports") == []
    for method, path, body in (("GET", f"{reports}/regionreports", None), ("GET", f"{reports}/namespaces/default/regionreports", None),
                               ("GET", f"{reports}/namespaces/default/regionreports/eu-0", None),
                               ("POST", f"{reports}/namespaces/default/regionreports", report)):
        code, answer = await call(http, method, path, body)
        assert code == 404
        assert_status(answer, 404, "NotFound")
        assert answer["message"] == "the server could not find the requested resource"
    code, groups = await call(http, "GET", "/apis")
    assert "gateway-publisher.ome.io" not in {g["name"] for g in groups["groups"]}
    assert (await call(http, "GET", reports))[0] == 404
    assert (await call(http, "GET", f"{TM}/trafficmaps"))[0] == 200  # other resources are served
    kube_api.install("regionreports")
    code, listed = await call(http, "GET", f"{reports}/regionreports")
    assert code == 200 and listed["items"] == []
    assert (await call(http, "POST", f"{reports}/namespaces/default/regionreports", report))[0] == 201
    with pytest.raises(ValueError):
        kube_api.uninstall("leases")


async def test_fail_next_answers_429_as_too_many_requests(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.fail_next(1, status=429, verb="list")
    code, body = await call(http, "GET", f"{TM}/trafficmaps")
    assert code == 429
    assert_status(body, 429, "TooManyRequests")
    assert (await call(http, "GET", f"{TM}/trafficmaps"))[0] == 200


async def test_latency_delays_replies(kube_api: FakeKubeAPI) -> None:  # noqa: F811
    kube_api.set_latency(1)
    async with aiohttp.ClientSession(base_url=kube_api.url, timeout=aiohttp.ClientTimeout(total=0.1)) as slow:
        with pytest.raises(asyncio.TimeoutError):
            await call(slow, "GET", map_path())
    await eventually(lambda: kube_api.in_flight == 0)


async def test_lowering_latency_ends_the_waits_of_requests_already_waiting(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    kube_api.set_latency(60)
    waiting = asyncio.create_task(call(http, "GET", map_path()))
    await eventually(lambda: kube_api.in_flight == 1)
    assert not waiting.done()
    kube_api.set_latency(0)
    code, _ = await asyncio.wait_for(waiting, 5)
    assert code == 200


async def test_requests_are_counted_by_verb_type_and_manager(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map())
    await call(http, "GET", f"{TM}/trafficmaps")
    await apply_status(http, "one", status_apply("llama", condition()))
    await apply_status(http, "one", status_apply("llama", condition()))
    assert kube_api.count("list") == 1
    assert kube_api.count("patch", path=map_path(suffix="/status"), content_type=PATCH_APPLY, field_manager="one") == 2
    assert kube_api.count("patch", field_manager="two") == 0


# --- 9. leases -----------------------------------------------------------------------------------


async def test_lease_replace_is_optimistic(http: aiohttp.ClientSession) -> None:
    lease = {"metadata": {"name": "lock"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}}
    code, created = await call(http, "POST", LEASES, lease, pretty="True")
    assert code == 201 and created["kind"] == "Lease"
    _, got = await call(http, "GET", f"{LEASES}/lock")
    code, _ = await call(http, "PUT", f"{LEASES}/lock", {**got, "spec": {**got["spec"], "holderIdentity": "b"}})
    assert code == 200
    code, body = await call(http, "PUT", f"{LEASES}/lock", {**got, "spec": {**got["spec"], "holderIdentity": "c"}})
    assert code == 409
    assert_status(body, 409, "Conflict")


async def test_two_leader_elections_take_turns(kubeconfig) -> None:  # noqa: F811
    from kubernetes_asyncio import config
    from kubernetes_asyncio.client import ApiClient, Configuration
    from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
    from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

    leading: list[str] = []

    async def candidate(identity: str, client: ApiClient) -> None:
        async def lead() -> None:
            leading.append(identity)
            await asyncio.Event().wait()

        async def stopped() -> None:
            return None

        lock = LeaseLock("publisher", "default", identity, client)
        cfg = electionconfig.Config(lock, lease_duration=2, renew_deadline=1.5, retry_period=1, onstarted_leading=lead, onstopped_leading=stopped)
        await leaderelection.LeaderElection(cfg).run()

    clients = []
    for _ in range(2):
        client_config = Configuration()
        await config.load_kube_config(config_file=str(kubeconfig), client_configuration=client_config)
        clients.append(ApiClient(configuration=client_config))
    tasks = {name: asyncio.create_task(candidate(name, c)) for name, c in zip(("a", "b"), clients, strict=True)}
    try:
        await eventually(lambda: len(leading) == 1, timeout=10)
        first = leading[0]
        tasks[first].cancel()
        await eventually(lambda: len(leading) == 2, timeout=15)
        assert leading[1] != first
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for client in clients:
            await client.close()
        # LeaderElection.run starts `lead` with a bare create_task; let cancellations settle.
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and "lead" in repr(t)]:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# --- 10. discovery -------------------------------------------------------------------------------


async def test_discovery_documents(http: aiohttp.ClientSession) -> None:
    _, version = await call(http, "GET", "/version")
    _, groups = await call(http, "GET", "/apis")
    assert version["major"] == "1"
    assert {g["name"] for g in groups["groups"]} == {"ome.io", "gateway.networking.k8s.io", "gateway-publisher.ome.io", "coordination.k8s.io"}


# --- end to end through kubernetes_asyncio --------------------------------------------------------


async def test_kubernetes_asyncio_lists_watches_and_applies_status(kube_api: FakeKubeAPI, kubeconfig) -> None:  # noqa: F811
    from kubernetes_asyncio import client, config, watch

    kube_api.create(make_map("a"))
    client_config = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=client_config)
    async with client.ApiClient(configuration=client_config) as api_client:
        api = client.CustomObjectsApi(api_client)
        listed = await api.list_cluster_custom_object("ome.io", "v1beta1", "trafficmaps")
        assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
        body = status_apply("a", condition("gateway-publisher.ome.io/eu", reason="Published"))
        patched = await api.patch_namespaced_custom_object_status(
            "ome.io", "v1beta1", "default", "trafficmaps", "a", body,
            field_manager="ome-gateway-publisher-eu", force=True, _content_type=PATCH_APPLY,
        )
        assert "gateway-publisher.ome.io/eu" in conditions_of(patched)
        events = []
        async with watch.Watch() as stream:
            async for event in stream.stream(
                api.list_cluster_custom_object, "ome.io", "v1beta1", "trafficmaps",
                resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=5,
            ):
                events.append(event)
                break
    assert events[0]["type"] == "MODIFIED"
    assert "gateway-publisher.ome.io/eu" in conditions_of(events[0]["object"])
    assert kube_api.count("patch", content_type=PATCH_APPLY, field_manager="ome-gateway-publisher-eu") == 1


# --- 11. what kubectl needs -----------------------------------------------------------------------


async def test_group_versions_list_their_resources_for_kubectl(http: aiohttp.ClientSession) -> None:
    _, ome = await call(http, "GET", TM)
    _, core = await call(http, "GET", "/api/v1")
    assert ome["kind"] == "APIResourceList" and ome["groupVersion"] == "ome.io/v1beta1"
    by_name = {r["name"]: r for r in ome["resources"]}
    assert set(by_name) == {"trafficmaps", "trafficmaps/status", "inferenceservices", "inferenceservices/status"}
    assert by_name["trafficmaps"]["singularName"] == "trafficmap" and by_name["trafficmaps"]["kind"] == "TrafficMap"
    assert by_name["trafficmaps"]["namespaced"] and {"get", "list", "watch", "patch"} <= set(by_name["trafficmaps"]["verbs"])
    assert [r["name"] for r in core["resources"]] == ["services"] and core["groupVersion"] == "v1"
    status, body = await call(http, "GET", "/apis/ome.io/v2")
    assert status == 404
    assert_status(body, 404, "NotFound")


async def test_watch_with_initial_events_ends_them_with_an_annotated_bookmark(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    kube_api.create(make_map("a"))
    kube_api.create(make_map("b"))
    params = {"sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan", "allowWatchBookmarks": "true",
              "fieldSelector": "metadata.name=a"}
    async with await open_watch(http, f"{TM}/namespaces/default/trafficmaps", **params) as response:
        stream = Stream(response)
        added, end = await stream.take(2)
        stored = kube_api.get(TM_RESOURCE, "default", "a")
        assert stored is not None
        kube_api.update({**stored, "spec": {**stored["spec"], "mode": "All"}})
        changed = await stream.next()
    assert (added["type"], added["object"]["metadata"]["name"]) == ("ADDED", "a")
    assert end["type"] == "BOOKMARK"
    assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(end["object"]["metadata"]["resourceVersion"]) >= int(added["object"]["metadata"]["resourceVersion"])
    assert changed is not None and changed["type"] == "MODIFIED"


# --- RegionReports (the chart's CRD, no status subresource) ----------------------------------------

REPORTS = "/apis/gateway-publisher.ome.io/v1alpha1"


def verdict(**overrides: Any) -> dict[str, Any]:
    return {"observedGeneration": 1, "status": "True", "reason": "Published", "message": "m",
            "lastTransitionTime": "2025-01-02T03:04:05Z", **overrides}


def region_report(name: str = "eu-0", namespace: str = "default", **maps: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "gateway-publisher.ome.io/v1alpha1",
        "kind": "RegionReport",
        "metadata": {"name": name, "namespace": namespace, "labels": {"gateway-publisher.ome.io/region": name.rsplit("-", 1)[0]}},
        "region": name.rsplit("-", 1)[0],
        "maps": maps,
    }


def report_path(name: str = "", namespace: str = "default") -> str:
    return f"{REPORTS}/namespaces/{namespace}/regionreports" + (f"/{name}" if name else "")


async def test_region_reports_are_namespaced_listed_by_label_and_deleted(http: aiohttp.ClientSession) -> None:
    for name, namespace in (("eu-0", "prod"), ("eu-1", "prod"), ("us-0", "prod"), ("eu-0", "dev")):
        code, created = await call(http, "POST", report_path(namespace=namespace), region_report(name, namespace, chat=verdict()))
        assert code == 201 and created["metadata"]["generation"] == 1, created
    _, listed = await call(http, "GET", f"{REPORTS}/regionreports", labelSelector="gateway-publisher.ome.io/region=eu")
    assert listed["kind"] == "RegionReportList"
    assert sorted((o["metadata"]["namespace"], o["metadata"]["name"]) for o in listed["items"]) == [("dev", "eu-0"), ("prod", "eu-0"), ("prod", "eu-1")]
    _, prod = await call(http, "GET", report_path(namespace="prod"))
    assert len(prod["items"]) == 3
    code, got = await call(http, "GET", report_path("eu-0", "dev"))
    assert code == 200 and got["maps"] == {"chat": verdict()}
    code, _ = await call(http, "DELETE", report_path("eu-0", "dev"))
    assert code == 200
    code, body = await call(http, "GET", report_path("eu-0", "dev"))
    assert code == 404
    assert_status(body, 404, "NotFound")


async def test_region_report_maps_are_atomic_on_apply(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    code, first = await call(http, "PATCH", report_path("eu-0"), region_report(chat=verdict(), embed=verdict()),
                             content_type=PATCH_APPLY, fieldManager="ome-gateway-publisher-eu")
    assert code == 201
    (owned,) = first["metadata"]["managedFields"]
    # One field, whatever the number of maps: x-kubernetes-map-type: atomic.
    assert owned["fieldsV1"]["f:maps"] == {} and set(owned["fieldsV1"]) == {"f:maps", "f:region", "f:metadata"}
    code, second = await call(http, "PATCH", report_path("eu-0"), region_report(chat=verdict(status="False", reason="ApplyFailed")),
                              content_type=PATCH_APPLY, fieldManager="ome-gateway-publisher-eu")
    assert code == 200
    assert second["maps"] == {"chat": verdict(status="False", reason="ApplyFailed")}  # replaced whole: embed is gone
    assert second["metadata"]["generation"] == 2


async def test_region_report_apply_and_delete_honour_a_resource_version(kube_api: FakeKubeAPI, http: aiohttp.ClientSession) -> None:  # noqa: F811
    _, created = await call(http, "POST", report_path(), region_report(chat=verdict()))
    stale = created["metadata"]["resourceVersion"]
    body = region_report(chat=verdict(message="new"))
    body["metadata"]["resourceVersion"] = stale
    code, applied = await call(http, "PATCH", report_path("eu-0"), body, content_type=PATCH_APPLY, fieldManager="eu", force="true")
    assert code == 200 and applied["maps"]["chat"]["message"] == "new"
    code, refused = await call(http, "PATCH", report_path("eu-0"), body, content_type=PATCH_APPLY, fieldManager="eu", force="true")
    assert code == 409
    assert_status(refused, 409, "Conflict")
    code, refused = await call(http, "DELETE", report_path("eu-0"), {"preconditions": {"resourceVersion": stale}})
    assert code == 409
    code, _ = await call(http, "PUT", report_path("eu-0"), region_report(chat=verdict()))
    assert code == 422  # a custom resource's update must carry its resourceVersion
    code, _ = await call(http, "DELETE", report_path("eu-0"), {"preconditions": {"resourceVersion": applied["metadata"]["resourceVersion"]}})
    assert code == 200


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"maps": {"chat": verdict(status="Yes")}}, id="status"),
        pytest.param({"maps": {"chat": verdict(reason="not a reason")}}, id="reason"),
        pytest.param({"maps": {"chat": verdict(observedGeneration=-1)}}, id="generation"),
        pytest.param({"maps": {"chat": verdict(lastTransitionTime="yesterday")}}, id="time"),
        pytest.param({"maps": {"chat": verdict(message="x" * 32769)}}, id="message"),
        pytest.param({"maps": {"chat": {**verdict(), "extra": 1}}}, id="entry-field"),
        pytest.param({"maps": {"chat": {"status": "True"}}}, id="required"),
        pytest.param({"spec": {}}, id="top-level-field"),
        pytest.param({"maps": []}, id="maps-type"),
    ],
)
async def test_invalid_region_report_is_rejected(http: aiohttp.ClientSession, bad: dict[str, Any]) -> None:
    code, body = await call(http, "POST", report_path(), {**region_report(), **bad})
    assert code == 422
    assert_status(body, 422, "Invalid")
