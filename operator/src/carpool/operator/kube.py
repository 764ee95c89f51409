"""The one module that talks to the Kubernetes API (besides kopf's own watching and patching).

A thin aiohttp client built from the same `kopf.ConnectionInfo` kopf logs in with, so the operator
needs no second Kubernetes library. Every write of a child is a server-side apply of the *full*
desired object with the fixed field manager and `force`: the API server creates the object when it is
absent, takes back fields someone else edited (drift), and removes fields this manager owned and no
longer sends (a toleration or a limit taken out of the spec). Objects are never created with a POST:
fields created that way belong to an `Update` manager, and a later apply could not remove them.

`ACCESS` declares which calls the operator makes on which kind; `Kube` refuses any other, and the
chart's RBAC is generated from the same table (tests/chart/test_rbac.py checks both ways).

Each `Kube` has a connection pool (aiohttp session) of its own: the leader-election Lease is renewed
through a second one (run.py), so a storm of reconciles queued on the first cannot delay a renewal. Under
leader election the writes pass a `write_guard` (`leader.Fence`): refused once this replica may no longer
write, and each cut off when its authority runs out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from carpool.operator import API_VERSION, FIELD_MANAGER, KIND, PLURAL
from carpool.operator.token import TokenFile

PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    (API_VERSION, KIND): PLURAL,
}
"""Every (apiVersion, kind) the operator can address, and its resource name in API paths. Public so that
tests/chart can check that `rbac.py` grants each of them."""

_CHILD = ("get", "apply", "delete")
_REMOVABLE_CHILD = ("get", "apply", "delete")
ACCESS: dict[tuple[str, str], tuple[str, ...]] = {
    # Always wanted: applied (which creates them), never deleted by the operator (garbage collection
    # does that). Yet `delete` is granted: the OwnerReferencesPermissionEnforcement admission plugin
    # lets only who may delete an object change its owner references, which taking over the children
    # of a re-created BatchedModel does (`plan.superseded`); without it that apply is 403.
    ("v1", "ConfigMap"): _CHILD,
    ("v1", "Service"): _CHILD,
    # Wanted or not depending on the spec: deleted when the spec stops asking for them. The workload is a
    # Deployment, or a LeaderWorkerSet when the model spans several nodes: switching deletes the other.
    ("apps/v1", "Deployment"): _REMOVABLE_CHILD,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): _REMOVABLE_CHILD,
    ("policy/v1", "PodDisruptionBudget"): _REMOVABLE_CHILD,
    ("keda.sh/v1alpha1", "ScaledObject"): _REMOVABLE_CHILD,
    # The workload of a model split over several nodes; deleted when it goes back to one (a Deployment).
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): _REMOVABLE_CHILD,
    ("v1", "PersistentVolumeClaim"): _REMOVABLE_CHILD,
    ("networking.k8s.io/v1", "NetworkPolicy"): _REMOVABLE_CHILD,
    # The Gateway API Inference Extension's pool of the model's pods (`spec.routing: inferencePool`).
    ("inference.networking.k8s.io/v1", "InferencePool"): _REMOVABLE_CHILD,
    # The runtime pods are only listed, to explain in the status why none is ready.
    ("v1", "Pod"): ("list",),
    # The owner: read, and its status written.
    (API_VERSION, KIND): ("get", "patch_status"),
    # Leader election between replicas (`leader.py`): created once, then replaced with its resourceVersion.
    ("coordination.k8s.io/v1", "Lease"): ("get", "create", "replace"),
}
"""The `Kube` methods the operator calls on each kind (`apply` is an HTTP PATCH that may create)."""


class KubeError(Exception):
    """An API call failed. `status` is the HTTP status (0 when the server could not be reached);
    `retry_after` the seconds a 429 or 503 asked the client to wait (its `Retry-After` header)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after

    @property
    def transient(self) -> bool:
        return self.status == 0 or self.status in (409, 429) or self.status >= 500

    @property
    def reason(self) -> str:
        """What went wrong, as a condition reason and the `reason` label of the error metric."""
        return _REASONS.get(self.status) or ("ApiServerError" if self.status >= 500 else "ApiError")


_REASONS = {
    0: "ApiUnreachable",
    401: "Unauthorized",
    403: "Forbidden",
    409: "Conflict",
    429: "TooManyRequests",
}


def retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (the API server sends whole seconds; an HTTP date, which
    it never sends, is ignored)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str

    @classmethod
    def of(cls, manifest: Mapping[str, Any], namespace: str | None = None) -> ObjectRef:
        meta = manifest["metadata"]
        return cls(manifest["apiVersion"], manifest["kind"], namespace or meta["namespace"], meta["name"])

    def collection(self) -> str:
        plural = PLURALS[(self.api_version, self.kind)]
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{root}/namespaces/{self.namespace}/{plural}"

    def path(self, subresource: str | None = None) -> str:
        tail = f"/{subresource}" if subresource else ""
        return f"{self.collection()}/{self.name}{tail}"


REQUEST_TIMEOUT_SECONDS = 30.0
"""The longest one call waits for its answer (a caller may pass a shorter `limit`)."""

WriteGuard = Callable[[str], contextlib.AbstractAsyncContextManager[float]]
"""Around one write (named for errors): raises when the write must not be made, else yields the seconds
it may take at most (`leader.Fence.write`)."""


class Kube:
    """Kubernetes API calls the reconciler needs. `connect()` it before use (the login handler does).

    `user_agent` names the client in the API server's audit log; `write_guard`, when set, is entered
    around every call but a GET."""

    def __init__(self, user_agent: str = FIELD_MANAGER, write_guard: WriteGuard | None = None) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._retired: list[aiohttp.ClientSession] = []
        self.user_agent = user_agent
        self.write_guard = write_guard
        self._token_file: TokenFile | None = None

    @property
    def connected(self) -> bool:
        return self._info is not None

    def connect(self, info: kopf.ConnectionInfo, token_file: Path | None = None) -> None:
        """Use these credentials from now on (called again when kopf re-authenticates). `token_file`:
        where the bearer token is rotated (`token.TokenFile`: read again when it changes)."""
        if self._rotated_token_only(info, token_file):
            self._info = info
            return
        self._token_file = TokenFile(token_file) if token_file is not None else None
        if info != self._info:
            self._info = info
            if self._session is not None:
                self._retired.append(self._session)  # requests in flight may still use it
            self._session = None

    def _rotated_token_only(self, info: kopf.ConnectionInfo, token_file: Path | None) -> bool:
        """The same server and token file as now, only a newer token (kopf logging in again after the
        credentials' expiration): the session stays, its requests read the file themselves."""
        if token_file is None or self._token_file is None or self._token_file.path != token_file:
            return False
        if self._info is None:
            return False
        bare = {"token": None, "expiration": None}
        return dataclasses.replace(info, **bare) == dataclasses.replace(self._info, **bare)  # type: ignore[arg-type]

    def _authorization(self) -> dict[str, str]:
        """The current token of a rotated token file (else the session's own header stands)."""
        if self._token_file is None:
            return {}
        token = self._token_file.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def close(self) -> None:
        for session in [*self._retired, self._session]:
            if session is not None:
                await session.close()
        self._session = None
        self._retired.clear()

    def _client(self) -> tuple[aiohttp.ClientSession, str]:
        if self._info is None:
            raise KubeError(0, "not logged in to the Kubernetes API yet")
        if self._session is None:
            context: ssl.SSLContext | bool = self._info.as_ssl_context()
            if self._info.insecure:
                context = False
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context),
                headers={**self._info.as_http_headers(), "User-Agent": self.user_agent},
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS),
            )
        return self._session, self._info.server.rstrip("/")

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        limit: float | None = None,
    ) -> dict[str, Any] | None:
        if method != "GET" and self.write_guard is not None:
            async with self.write_guard(f"{method} {path}") as left:
                return await self._send(method, path, body, params, content_type, min(left, limit or left))
        return await self._send(method, path, body, params, content_type, limit)

    async def _send(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
        params: Mapping[str, str] | None,
        content_type: str,
        limit: float | None,
    ) -> dict[str, Any] | None:
        session, server = self._client()
        data = json.dumps(body) if body is not None else None
        timeout = session.timeout if limit is None else aiohttp.ClientTimeout(total=limit)
        try:
            async with session.request(
                method,
                server + path,
                data=data,
                params=params,
                headers={"Content-Type": content_type, "Accept": "application/json", **self._authorization()},
                timeout=timeout,
            ) as response:
                text = await response.text()
                if response.status == 404 and method == "GET":
                    return None
                if response.status >= 400:
                    wait = retry_after(response.headers.get("Retry-After"))
                    raise KubeError(response.status, _message(text), wait)
                return json.loads(text) if text else {}
        except aiohttp.ClientError as exc:
            raise KubeError(0, f"{method} {path}: {exc}") from exc
        except TimeoutError as exc:
            raise KubeError(0, f"{method} {path}: timed out") from exc

    async def get(self, ref: ObjectRef) -> dict[str, Any] | None:
        """The object, or None when it (or its API) does not exist."""
        _allowed(ref, "get")
        return await self._call("GET", ref.path())

    async def list(self, ref: ObjectRef, label_selector: str) -> list[dict[str, Any]]:
        """Objects of `ref`'s kind in its namespace matching the selector (filtered by the server)."""
        _allowed(ref, "list")
        result = await self._call("GET", ref.collection(), params={"labelSelector": label_selector})
        return list((result or {}).get("items") or [])

    async def apply(
        self, manifest: Mapping[str, Any], *, manager: str = FIELD_MANAGER, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply of the manifest as `manager`: creates the object when absent; fields the
        manager set before and leaves out now are removed. `force` takes over conflicting fields;
        without it, a conflict is a `KubeError` with status 409."""
        ref = ObjectRef.of(manifest)
        _allowed(ref, "apply")
        # Strict: an unknown or duplicated field in a passed-through object (tolerations, affinity,
        # volumes) is refused naming it, never silently dropped. (Server-side apply answers some of these
        # with 500 "field not declared in schema"; the reconciler reads that as a spec error.)
        params = {"fieldManager": manager, "fieldValidation": "Strict"}
        if force:
            params["force"] = "true"
        result = await self._call(
            "PATCH",
            ref.path(),
            body=manifest,
            params=params,
            content_type="application/apply-patch+yaml",  # JSON is YAML
        )
        return result or {}

    async def json_patch(self, ref: ObjectRef, operations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """A JSON Patch (RFC 6902) of the object: used to remove list entries other managers added,
        which a server-side apply cannot take away (`diff.foreign_items`). Allowed where `apply` is."""
        _allowed(ref, "apply")
        result = await self._call(
            "PATCH",
            ref.path(),
            body=operations,
            params={"fieldManager": FIELD_MANAGER, "fieldValidation": "Strict"},
            content_type="application/json-patch+json",
        )
        return result or {}

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """POST a new object (409 when it exists). Only for objects no apply manages (the Lease)."""
        ref = ObjectRef.of(manifest)
        _allowed(ref, "create")
        return await self._call("POST", ref.collection(), body=manifest) or {}

    async def replace(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the object; with its `metadata.resourceVersion`, a 409 when someone wrote it meanwhile."""
        ref = ObjectRef.of(manifest)
        _allowed(ref, "replace")
        return await self._call("PUT", ref.path(), body=manifest) or {}

    async def delete(self, ref: ObjectRef) -> bool:
        _allowed(ref, "delete")
        try:
            await self._call("DELETE", ref.path(), body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(self, ref: ObjectRef, status: Mapping[str, Any]) -> None:
        _allowed(ref, "patch_status")
        await self._call(
            "PATCH",
            ref.path("status"),
            body={"status": status},
            params={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )


def _allowed(ref: ObjectRef, method: str) -> None:
    if method not in ACCESS.get((ref.api_version, ref.kind), ()):
        raise KubeError(0, f"{method} on {ref.kind} is not declared in kube.ACCESS (nor granted by RBAC)")


def _message(text: str) -> str:
    try:
        return str(json.loads(text).get("message") or text)
    except (ValueError, AttributeError):
        return text[:500]
