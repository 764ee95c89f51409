"""Reconciliation: the desired children of a BatchedModel, applied where they differ, and its status.

Called by the kopf handlers for the BatchedModel itself (create, update, resume) and for events on its
children (someone edited or deleted one; a Deployment's pods became ready). Both paths run the same
idempotent steps under a per-model lock: build (pure), compare with the live children, create or
server-side apply what differs, delete children the spec no longer wants, compute the status (pure)
and write it only when it changed. Writing nothing when nothing changed is what keeps child events
from turning into a loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from carpool.operator import API_VERSION, KIND
from carpool.operator.diff import differences
from carpool.operator.kube import Kube, KubeError, ObjectRef
from carpool.operator.metrics import CHILD_WRITES, DURATION, ERRORS, RECONCILES
from carpool.operator.resources import Children, build_children, initial_replicas
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES
from carpool.operator.status.compute import compute_status, status_patch
from carpool.operator.status.model import ConditionStatus, ConditionType
from carpool.operator.validation import SpecError

RETRY_DELAY_SECONDS = 10.0
MISSING_API_DELAY_SECONDS = 60.0


@dataclass
class OperatorState:
    """Shared by all handlers through kopf's memo (kopf copies the memo shallowly per object)."""

    kube: Kube = field(default_factory=Kube)
    connection: kopf.ConnectionInfo | None = None
    """Fixed credentials (tests, or an explicit server); None means in-cluster, then kubeconfig."""
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    metrics_namespaces: tuple[str, ...] = DEFAULT_METRICS_NAMESPACES
    """Namespaces Prometheus scrapes the runtime pods from (their NetworkPolicy admits them)."""

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def _ref(body: Mapping[str, Any]) -> ObjectRef:
    meta = body["metadata"]
    return ObjectRef(API_VERSION, KIND, meta.get("namespace") or "default", meta["name"])


def _owned_by(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner.get("metadata", {}).get("uid")
    refs = child.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("kind") == KIND and (uid is None or ref.get("uid") == uid) for ref in refs)


async def _sync_child(
    kube: Kube, manifest: dict[str, Any], children: Children, logger: Any
) -> dict[str, Any]:
    ref = ObjectRef.of(manifest)
    live = await kube.get(ref)
    if live is None:
        if manifest["kind"] == "Deployment" and "replicas" not in manifest["spec"]:
            # Created with the autoscaler's minimum; from then on the autoscaler owns the count (the
            # create is not an apply, so later applies that leave replicas out never reset it).
            manifest = {**manifest, "spec": {**manifest["spec"], "replicas": initial_replicas(children.spec)}}
        logger.info(f"Creating {ref.kind} {ref.name}")
        CHILD_WRITES.labels(ref.kind, "create").inc()
        return await kube.create(manifest)
    changed = differences(manifest, live)
    if not changed:
        return live
    logger.info(f"Applying {ref.kind} {ref.name}: {', '.join(changed[:5])} differ")
    CHILD_WRITES.labels(ref.kind, "apply").inc()
    return await kube.apply(manifest)


async def _live(kube: Kube, body: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any] | None:
    ref = _ref(body)
    return await kube.get(ObjectRef(api_version, kind, ref.namespace, ref.name))


async def reconcile(
    state: OperatorState,
    body: Mapping[str, Any],
    *,
    trigger: str,
    logger: Any = None,
    report_spec_errors: bool = True,
) -> None:
    """Bring the children and status of one BatchedModel in line with its spec.

    Raises `kopf.PermanentError` for a spec that cannot work (after writing the condition and, when
    `report_spec_errors`, an Event) and `kopf.TemporaryError` for API failures that may pass.
    """
    log = logger or logging.getLogger("carpool.operator")
    ref = _ref(body)
    started = time.perf_counter()
    result = "ok"
    try:
        async with state.lock(ref.namespace, ref.name):
            await _reconcile(state.kube, body, log, report_spec_errors, state.metrics_namespaces)
    except kopf.PermanentError:
        result = "invalid"
        raise
    except kopf.TemporaryError:
        result = "retry"
        raise
    except Exception:
        result = "error"
        ERRORS.labels("Unexpected").inc()
        raise
    finally:
        RECONCILES.labels(trigger, result).inc()
        DURATION.observe(time.perf_counter() - started)


async def _reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    logger: Any,
    report_spec_errors: bool,
    metrics_namespaces: tuple[str, ...] = DEFAULT_METRICS_NAMESPACES,
) -> None:
    try:
        try:
            children = build_children(body, metrics_namespaces)
            await _apply(kube, body, children, logger)
        except SpecError as error:
            ERRORS.labels(error.reason).inc()
            await _report_spec_error(kube, body, error)
            if report_spec_errors:
                kopf.warn(
                    kopf.Body(cast(kopf.RawBody, dict(body))), reason=error.reason, message=error.message
                )
                raise kopf.PermanentError(error.message) from None
    except KubeError as exc:
        ERRORS.labels("ApiError").inc()
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY_SECONDS) from exc


async def _report_spec_error(kube: Kube, body: Mapping[str, Any], error: SpecError) -> None:
    deployment = await _live(kube, body, "apps/v1", "Deployment")
    status = compute_status(
        generation=body.get("metadata", {}).get("generation"),
        previous=body.get("status") or {},
        now=datetime.datetime.now(datetime.UTC),
        deployment=deployment,
        autoscaling=False,
        spec_error=(error.reason, error.message),
    )
    await _write_status(kube, _ref(body), body.get("status") or {}, status_patch(status))


async def _apply(kube: Kube, body: Mapping[str, Any], children: Children, logger: Any) -> None:
    ref = _ref(body)
    live: dict[str, dict[str, Any]] = {}
    missing_api: str | None = None
    for manifest in children.manifests:
        try:
            live[manifest["kind"]] = await _sync_child(kube, manifest, children, logger)
        except KubeError as exc:
            if exc.status == 404 and manifest["kind"] == "ScaledObject":
                missing_api = "cannot create a keda.sh/v1alpha1 ScaledObject: is KEDA installed?"
                continue
            if exc.status in (400, 422):
                # The API server refused what the spec asked for (a pass-through field such as
                # affinity or tolerations is malformed): a spec problem, not one a retry fixes.
                raise SpecError(
                    "RejectedByApiServer", f"the API server refused the {manifest['kind']}: {exc.message}"
                ) from None
            raise
    for gone in children.absent:
        child_ref = ObjectRef(gone.api_version, gone.kind, ref.namespace, gone.name)
        found = await kube.get(child_ref)
        if found is not None and _owned_by(found, body):
            logger.info(f"Deleting {gone.kind} {gone.name}: the spec no longer wants it")
            CHILD_WRITES.labels(gone.kind, "delete").inc()
            await kube.delete(child_ref)

    scaling = children.spec.autoscaling
    previous = body.get("status") or {}
    status = compute_status(
        generation=body.get("metadata", {}).get("generation"),
        previous=previous,
        now=datetime.datetime.now(datetime.UTC),
        deployment=live.get("Deployment"),
        hpa=live.get("HorizontalPodAutoscaler"),
        scaled_object=live.get("ScaledObject"),
        autoscaling=scaling.enabled,
        endpoint=children.endpoint,
        selector=children.selector,
        config_hash=children.config_hash,
    )
    if missing_api is not None:
        for condition in status.conditions:
            if condition.type == ConditionType.AUTOSCALING:
                condition.status = ConditionStatus.FALSE
                condition.reason = "AutoscalerApiMissing"
                condition.message = missing_api
    await _write_status(kube, ref, previous, status_patch(status))
    if missing_api is not None:
        # The API may appear later (KEDA installed after the operator): retry, but slowly.
        raise kopf.TemporaryError(missing_api, delay=MISSING_API_DELAY_SECONDS)


def _same(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return all(previous.get(key) == value for key, value in new.items())


async def _write_status(kube: Kube, ref: ObjectRef, previous: Mapping[str, Any], new: dict[str, Any]) -> None:
    if not _same(previous, new):
        await kube.patch_status(ref, new)


async def reconcile_owner(state: OperatorState, child: Mapping[str, Any], logger: Any = None) -> None:
    """A child changed (or was deleted): reconcile the BatchedModel that owns it, if it still exists."""
    meta = child.get("metadata", {})
    namespace = meta.get("namespace") or "default"
    for owner in meta.get("ownerReferences") or []:
        if owner.get("kind") != KIND or owner.get("apiVersion") != API_VERSION:
            continue
        body = await state.kube.get(ObjectRef(API_VERSION, KIND, namespace, owner["name"]))
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return  # being deleted: garbage collection removes the children
        if owner.get("uid") and body.get("metadata", {}).get("uid") not in (None, owner["uid"]):
            return  # a newer object with the same name; its own handlers take care of it
        try:
            await reconcile(state, body, trigger="child", logger=logger, report_spec_errors=False)
        except kopf.TemporaryError as exc:
            # Event handlers are not retried by kopf; the next child event or the BatchedModel's own
            # handlers (with their retries) get there.
            (logger or logging.getLogger("carpool.operator")).warning(f"child reconcile deferred: {exc}")
        return
