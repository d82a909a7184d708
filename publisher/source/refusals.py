"""Refusals: the API server's answers that mean our configuration is wrong, not the network, in one
line an operator can act on."""

from __future__ import annotations

from publisher.kube import KubeError, Resource


# Answers that mean our configuration is wrong (a request the server cannot read, e.g. a malformed
# label selector; credentials; RBAC; a missing CRD), not the network.
REFUSAL_CODES = (400, 401, 403, 404)


class SourceRefused(Exception):
    """The API server refused the source for a reason retrying will not fix: 400, 401, 403 or 404.
    The message names the verb, the resource, the namespace and what to change."""


def describe_refusal(exc: KubeError, verb: str, resource: Resource, namespace: str | None) -> str:
    """One line an operator can act on: what was refused, where, and the missing rule."""
    what = f"{verb} {resource.plural}.{resource.group} in {scope_in_words(namespace)}"
    if exc.code == 400:
        return f"{what}: 400 BadRequest: {exc.message} (check --label-selector)"
    if exc.code == 401:
        return (
            f"{what}: 401 Unauthorized: the API server did not accept our credentials "
            "(check the kubeconfig's user, or the ServiceAccount token of the pod)"
        )
    if exc.code == 403:
        scope = f"a Role in namespace {namespace} (and its RoleBinding)" if namespace else "a ClusterRole (and its ClusterRoleBinding)"
        return (
            f"{what}: 403 Forbidden: {exc.message}; missing RBAC rule in {scope}: "
            f'apiGroups: ["{resource.group}"], resources: ["{resource.plural}"], verbs: ["get", "list", "watch"]'
        )
    return (
        f"{what}: 404 NotFound: the API server does not serve {resource.api_version} {resource.plural} "
        "(is OME's CustomResourceDefinition installed on this cluster?)"
    )


def scope_in_words(namespace: str | None) -> str:
    """Where a source reads, in words: `namespace prod` or `all namespaces`."""
    return f"namespace {namespace}" if namespace else "all namespaces"
