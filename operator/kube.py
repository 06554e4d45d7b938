"""The operator's Kubernetes API calls, all of them: list by label, get, create, server-side apply, merge patch
(an Event's count), delete,
and the key the jobs' tokens derive from (`load_token_key`).

Objects travel as plain dicts, the form `children.py` renders and the API returns, so nothing here knows
about the kinds beyond where their endpoints are. Applying is server-side apply under one field manager,
forced only over an object this job already owns: a same-named object made by someone else is never
taken over, the API server reports the conflict instead.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client, config

from diloco.api.job import API_GROUP, API_VERSION, PLURAL
from diloco.operator.naming import MANAGER, TOKEN_KEY, TOKEN_KEY_SECRET
from diloco.operator.tokens import KEY_BYTES

RESOURCES: dict[str, tuple[str, str, bool]] = {
    "ConfigMap": ("v1", "configmaps", True),
    "Secret": ("v1", "secrets", True),
    "Service": ("v1", "services", True),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims", True),
    "Pod": ("v1", "pods", True),
    "Event": ("v1", "events", True),
    "Node": ("v1", "nodes", False),
    "Namespace": ("v1", "namespaces", False),
    "Deployment": ("apps/v1", "deployments", True),
    "StatefulSet": ("apps/v1", "statefulsets", True),
    "Job": ("batch/v1", "jobs", True),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies", True),
    "GRPCRoute": ("gateway.networking.k8s.io/v1", "grpcroutes", True),
    "DiLoCoJob": (f"{API_GROUP}/{API_VERSION}", PLURAL, True),
}
"""kind -> (apiVersion, plural, namespaced) of every kind the operator touches."""


class ApiError(Exception):
    """A refused API call, with the HTTP status and the API server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def namespace_terminating(self) -> bool:
        """The namespace is being deleted: the API server refuses anything new in it (a pass that looked before
        the deletion began finds out this way)."""
        return self.status == 403 and "because it is being terminated" in self.message


def pooled(configuration: client.Configuration, connections: int) -> client.ApiClient:
    """A client keeping up to `connections` connections, one per call in flight: a call finding the pool full
    would open one more, and discard it after, with a urllib3 warning."""
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 1, connections)
    return client.ApiClient(configuration)


def load_config(connections: int) -> client.ApiClient:
    """In a pod, its service account; elsewhere, the current kubeconfig context; a pool of `connections`."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return pooled(client.Configuration.get_default_copy(), connections)


def _path(kind: str, namespace: str | None, name: str | None = None) -> str:
    api_version, plural, namespaced = RESOURCES[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespaced else ""
    return f"{prefix}{scope}/{plural}" + (f"/{name}" if name else "")


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


METHODS = {"list": "GET", "get": "GET", "create": "POST", "apply": "PATCH", "patch": "PATCH", "delete": "DELETE"}
"""HTTP method of each verb the operator uses."""
RequestObserver = Callable[[str, str, int], None]
"""Told (verb: list, get, create, apply, patch or delete; kind; HTTP status) of every call made, e.g. to count
them as a metric."""


class Kube:
    """Synchronous JSON calls through the `kubernetes` client's connection pool and credentials."""

    def __init__(self, api: client.ApiClient, timeout: float = 30.0, observe: RequestObserver | None = None) -> None:
        self.api = api
        self.timeout = timeout
        self.observe = observe

    def _call(
        self,
        verb: str,
        kind: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any] | None:
        """The decoded reply; None for 404; ApiError for any other refusal."""
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        request = self.api.param_serialize(
            METHODS[verb],
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        response.read()
        if self.observe is not None:
            self.observe(verb, kind, response.status)
        if response.status == 404:
            return None
        payload = json.loads(response.data) if response.data else {}
        if not 200 <= response.status < 300:
            raise ApiError(response.status, payload.get("message", str(payload)))
        return payload

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every object of `kind` in `namespace` carrying all of `labels`."""
        reply = self._call("list", kind, _path(kind, namespace), [("labelSelector", selector(labels))])
        api_version = RESOURCES[kind][0]
        return [{"apiVersion": api_version, "kind": kind, **item} for item in (reply or {}).get("items", [])]

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self._call("get", kind, _path(kind, namespace, name))

    def apply(self, obj: Mapping[str, Any], force: bool) -> dict[str, Any]:
        """Server-side apply of `obj` (created if missing); `force` takes over fields other managers set."""
        meta = obj["metadata"]
        query = [("fieldManager", MANAGER), ("force", "true" if force else "false")]
        reply = self._call(
            "apply",
            obj["kind"],
            _path(obj["kind"], meta.get("namespace"), meta["name"]),
            query,
            body=dict(obj),
            content_type="application/apply-patch+yaml",
        )
        if reply is None:
            raise ApiError(404, f"{obj['kind']} {meta['name']}: the namespace or the kind does not exist")
        return reply

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Creates `obj`; None when an object of that name exists already (HTTP 409), left as it is."""
        meta = obj["metadata"]
        try:
            return self._call(
                "create",
                obj["kind"],
                _path(obj["kind"], meta.get("namespace")),
                body=dict(obj),
                content_type="application/json",
            )
        except ApiError as error:
            if error.status == 409:
                return None
            raise

    def patch(self, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch of the object; None when it does not exist."""
        return self._call(
            "patch", kind, _path(kind, namespace, name), body=dict(body), content_type="application/merge-patch+json"
        )

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        """Deletes in the background (dependents garbage-collected); an object already gone is fine."""
        self._call(
            "delete",
            kind,
            _path(kind, namespace, name),
            body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
            content_type="application/json",
        )


def _key_in(secret: Mapping[str, Any] | None) -> bytes | None:
    data = (secret or {}).get("data") or {}
    return base64.b64decode(data[TOKEN_KEY]) if TOKEN_KEY in data else None


def load_token_key(kube: Kube, namespace: str) -> bytes:
    """The operator's token key, from Secret `diloco-operator-token-key` in its own namespace, created with 256
    random bits by the first replica to look (create, not apply: two replicas starting at once both end up
    with the one that was stored first)."""
    key = _key_in(kube.get("Secret", namespace, TOKEN_KEY_SECRET))
    if key is None:
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": TOKEN_KEY_SECRET,
                    "namespace": namespace,
                    "labels": {"app.kubernetes.io/name": "diloco-operator", "app.kubernetes.io/managed-by": MANAGER},
                },
                "type": "Opaque",
                "data": {TOKEN_KEY: base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()},
            }
        )
        key = _key_in(kube.get("Secret", namespace, TOKEN_KEY_SECRET))
    if key is None or len(key) < KEY_BYTES:
        raise RuntimeError(f"Secret {namespace}/{TOKEN_KEY_SECRET} holds no {KEY_BYTES}-byte key under {TOKEN_KEY!r}")
    return key
