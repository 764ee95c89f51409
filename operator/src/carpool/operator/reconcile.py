"""Reconciliation: the desired children of a BatchedModel, applied where they differ, and its status.

Called by the kopf handlers for the BatchedModel itself (create, update, resume) and for events on its
children (someone edited or deleted one; a Deployment's pods became ready). Both paths run the same
idempotent steps under a per-model lock: build (pure), read the live children, plan the writes (pure,
`plan`: deletions first, then server-side applies of what changed, never over an object carpool does
not own), list the model's pods to explain failures, compute the status (pure) and write it only when
it changed. Writing nothing when nothing changed is what keeps child events
from turning into a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from carpool.operator import API_VERSION, FIELD_MANAGER, KIND
from carpool.operator.diff import applied_hash, drift, foreign_items, managed_by_others
from carpool.operator.informer import Informer
from carpool.operator.kube import Kube, KubeError, ObjectRef
from carpool.operator.metrics import CHILD_WRITES, DURATION, ERRORS, RECONCILES
from carpool.operator.plan import REPLICAS_MANAGER, Action, Plan, Step, plan_writes
from carpool.operator.resources import Children, build_children, initial_replicas
from carpool.operator.resources.inferencepool import KIND as POOL_KIND
from carpool.operator.resources.inferencepool import MISSING_MESSAGE as POOL_MISSING_MESSAGE
from carpool.operator.resources.labels import (
    INSTANCE_LABEL,
    LWS_API_VERSION,
    LWS_KIND,
    leader_worker_set_name,
)
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES
from carpool.operator.spec import DEFAULT_IMAGE
from carpool.operator.status.compute import api_error_status, compute_status, status_patch
from carpool.operator.status.model import BatchedModelStatus, ConditionStatus, ConditionType
from carpool.operator.status.pods import next_deadline, pod_problems
from carpool.operator.validation import SpecError

RETRY_DELAY_SECONDS = 10.0
SLOW_RETRY_SECONDS = 60.0
"""The slow retry's default (`carpool operator --slow-retry-period`, the chart's
`operator.slowRetryPeriodSeconds`): a child the API server refused (403, 5xx) and an API that is missing
(KEDA's, LeaderWorkerSet's, the InferencePool's) are tried again after it; a child whose name another
object holds, after half of it (`slow_retries`)."""
RECHECK_MARGIN_SECONDS = 2.0
RECHECK_HORIZON_SECONDS = 3600.0
"""A deleted pod's grace period ending within the hour is looked at again 2 s after it ends."""
ADMISSION_FIRST_DELAY_SECONDS = 2.0
ADMISSION_MAX_DELAY_SECONDS = 300.0
"""Back-off while an admission webhook denies a child: 2 s, doubling per denial in a row, at most 5 min."""


@dataclass(frozen=True)
class SlowRetries:
    """How long a model waits before it is tried again on its own after what a retry fixes only slowly:
    no sooner, or a refusing API server or a missing API would be asked again and again for nothing."""

    apply_failed: float
    """A child the API server refused (403: RBAC, a ResourceQuota; a 5xx)."""
    missing_api: float
    """An API the spec needs is not served (KEDA, LeaderWorkerSet, InferencePool CRDs): installed later."""
    conflict: float
    """A child's name is held by an object this model does not control: the user renames or deletes it."""

    @property
    def longest(self) -> float:
        return max(self.apply_failed, self.missing_api, self.conflict)


def slow_retries(period_s: float = SLOW_RETRY_SECONDS) -> SlowRetries:
    """The slow retries for a period: refusals and missing APIs after it, a name conflict after half."""
    if not period_s > 0:
        raise ValueError(f"the slow retry period must be above 0 seconds, not {period_s:g}")
    return SlowRetries(apply_failed=period_s, missing_api=period_s, conflict=period_s / 2)


DEFAULT_RETRIES = slow_retries()
"""The slow retries of an operator started without `--slow-retry-period`."""


@dataclass
class OperatorState:
    """Shared by all handlers through kopf's memo (kopf copies the memo shallowly per object)."""

    kube: Kube = field(default_factory=Kube)
    connection: kopf.ConnectionInfo | None = None
    """Fixed credentials (tests, or an explicit server); None means in-cluster, then kubeconfig."""
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    requeued: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)
    """Reconciles waiting to be retried (`requeue`), one per BatchedModel."""
    overrides: dict[tuple[str, str, str], tuple[str, frozenset[str]]] = field(default_factory=dict)
    """(namespace, kind, name) of a child -> (its desired hash, the paths admission rewrote when the
    operator applied it): not applied over again for that desired state, and reported."""
    denials: dict[tuple[str, str], int] = field(default_factory=dict)
    """Reconciles in a row an admission webhook denied, per BatchedModel (the back-off's exponent)."""
    metrics_namespaces: tuple[str, ...] = DEFAULT_METRICS_NAMESPACES
    """Namespaces Prometheus scrapes the runtime pods from (their NetworkPolicy admits them)."""
    runtime_image: str = DEFAULT_IMAGE
    """The image pods run unless their spec names one (`-cpu`, `-vllm` tags derived from it)."""
    informer: Informer | None = None
    """kopf's indexes of the children and pods (`informer`), once the operator has started."""
    waiting: set[tuple[str, str]] = field(default_factory=set)
    """BatchedModels an event-started reconcile waits for the lock of (`reconcile_named` coalesces)."""
    retries: SlowRetries = DEFAULT_RETRIES
    """How long a model waits before it is tried again after what a retry fixes only slowly."""

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def admission_delay(denials: int) -> float:
    """Seconds before retrying a BatchedModel whose last `denials` reconciles an admission webhook denied:
    doubling from ADMISSION_FIRST_DELAY_SECONDS up to ADMISSION_MAX_DELAY_SECONDS, so a policy that stays
    in place costs the API server and the webhook a request every five minutes, not every two seconds."""
    return min(ADMISSION_FIRST_DELAY_SECONDS * 2.0 ** (denials - 1), ADMISSION_MAX_DELAY_SECONDS)


def _ref(body: Mapping[str, Any]) -> ObjectRef:
    meta = body["metadata"]
    return ObjectRef(API_VERSION, KIND, meta.get("namespace") or "default", meta["name"])


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
    reread: bool = True,
    coalesce: bool = False,
    read_unwanted: bool = True,
) -> None:
    """Bring the children and status of one BatchedModel in line with its spec.

    `reread`: read the BatchedModel again once the lock is held (off only where the body is known
    to be current, e.g. a caller that just read it). `coalesce`: return at once when a reconcile of
    the same BatchedModel is already waiting for the lock: it reads everything once it holds it, so it
    covers this call's event too (a work queue holds a key once; a burst of pod and child status
    changes costs one reconcile, not one each). `read_unwanted`: read the children the spec does not
    want (to delete any that exist) from the server where the informer has not seen them; off for
    reconciles started by events (`reconcile_named`), see `_snapshot`.
    Raises `kopf.PermanentError` for a spec that cannot work (after writing the condition and, when
    `report_spec_errors`, an Event) and `kopf.TemporaryError` for API failures that may pass.
    """
    log = logger or logging.getLogger("carpool.operator")
    ref = _ref(body)
    key = (ref.namespace, ref.name)
    waiting = coalesce
    if coalesce:
        if key in state.waiting:
            return
        state.waiting.add(key)
    started = time.perf_counter()
    result = "ok"
    try:
        async with state.lock(ref.namespace, ref.name):
            if waiting:
                state.waiting.discard(key)
                waiting = False
            if reread:
                # Handlers queue behind the lock, and kopf may hand a handler a body older than the
                # one another handler just reconciled: reconciling that would undo the newer spec
                # (an autoscaler switch flip-flopping) or write the status again. Act on the latest.
                try:
                    fresh = await state.kube.get(ref)
                except KubeError as exc:
                    raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=api_failure(exc, log)) from exc
                if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
                    return
                body = fresh
            try:
                recheck = await _reconcile(
                    state.kube,
                    body,
                    log,
                    report_spec_errors,
                    state.metrics_namespaces,
                    state.overrides,
                    state.runtime_image,
                    state.informer,
                    read_unwanted,
                    state.retries,
                )
            except _AdmissionDenied as exc:
                count = state.denials[key] = state.denials.get(key, 0) + 1
                raise kopf.TemporaryError(str(exc), delay=admission_delay(count)) from None
            state.denials.pop(key, None)
            if recheck is not None:
                # A deleted pod's grace period ends then: if it is still there, its node is lost, and
                # no event will say so (`pod_problems`' StuckTerminating).
                requeue(state, ref.namespace, ref.name, recheck, log, "a pod's grace period ends", quiet=True)
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
        if waiting:
            state.waiting.discard(key)  # cancelled while waiting: the next event waits instead
        RECONCILES.labels(trigger, result).inc()
        DURATION.observe(time.perf_counter() - started)


async def _reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    logger: Any,
    report_spec_errors: bool,
    metrics_namespaces: tuple[str, ...] = DEFAULT_METRICS_NAMESPACES,
    overrides: dict[tuple[str, str, str], tuple[str, frozenset[str]]] | None = None,
    runtime_image: str = DEFAULT_IMAGE,
    informer: Informer | None = None,
    read_unwanted: bool = True,
    retries: SlowRetries = DEFAULT_RETRIES,
) -> float | None:
    """Returns in how many seconds to look again though no event may come (None: at the next event)."""
    try:
        try:
            children = build_children(body, metrics_namespaces, runtime_image)
            return await _apply(
                kube,
                body,
                children,
                logger,
                {} if overrides is None else overrides,
                informer,
                read_unwanted,
                retries,
            )
        except SpecError as error:
            ERRORS.labels(error.reason).inc()
            await _report_spec_error(kube, body, error)
            if report_spec_errors:
                kopf.warn(
                    kopf.Body(cast(kopf.RawBody, dict(body))), reason=error.reason, message=error.message
                )
                raise kopf.PermanentError(error.message) from None
            return None
    except KubeError as exc:
        delay = api_failure(exc, logger)
        await _report_api_error(kube, body, exc)
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=delay) from exc


API_FAILURES = {
    "ApiUnreachable": "Kubernetes API unreachable (connection refused, reset or timed out)",
    "TooManyRequests": "Kubernetes API throttled the operator (429 Too Many Requests)",
    "Unauthorized": "Kubernetes API refused the operator's credentials (401: token expired or revoked)",
    "Forbidden": "Kubernetes API forbade a call (403: RBAC, an admission plugin, a terminating namespace)",
    "Conflict": "Kubernetes API answered 409 Conflict",
    "ApiServerError": "Kubernetes API server failed (5xx)",
    "ApiError": "Kubernetes API call failed",
}
"""One log line per kind of API failure; the key is also the `reason` label of the error metric."""


def api_failure(exc: KubeError, logger: Any) -> float:
    """Count and log an API failure; return how long to wait before retrying (the server's
    `Retry-After` when it sent one, as a 429 from API Priority and Fairness does)."""
    delay = exc.retry_after if exc.retry_after is not None else RETRY_DELAY_SECONDS
    ERRORS.labels(exc.reason).inc()
    what = API_FAILURES.get(exc.reason, API_FAILURES["ApiError"])
    logger.warning(f"{what}; retrying in {delay:g} s: {exc}")
    return delay


async def _report_api_error(kube: Kube, body: Mapping[str, Any], exc: KubeError) -> None:
    """Degraded=True naming the failure while it lasts (the next reconcile that gets through computes
    the status afresh). Not tried where the write cannot succeed or would add to the load: the server
    unreachable, the credentials refused, the operator throttled."""
    if exc.status in (0, 401, 429):
        return
    previous = body.get("status") or {}
    patch = api_error_status(
        previous, datetime.datetime.now(datetime.UTC), exc.reason, f"the Kubernetes API answered {exc}"
    )
    with contextlib.suppress(KubeError):  # the failure is logged and counted already
        await _write_status(kube, _ref(body), previous, patch)


async def _report_spec_error(kube: Kube, body: Mapping[str, Any], error: SpecError) -> None:
    deployment = await _live(kube, body, "apps/v1", "Deployment")
    kind = "Deployment"
    if deployment is None:
        # A multi-node model's workload (None too where LeaderWorkerSets are not served).
        ref = _ref(body)
        lws = ObjectRef(LWS_API_VERSION, LWS_KIND, ref.namespace, leader_worker_set_name(ref.name))
        deployment = await kube.get(lws)
        kind = LWS_KIND if deployment is not None else kind
    status = compute_status(
        workload_kind=kind,
        generation=body.get("metadata", {}).get("generation"),
        previous=body.get("status") or {},
        now=datetime.datetime.now(datetime.UTC),
        deployment=deployment,
        autoscaling=False,
        spec_error=(error.reason, error.message),
    )
    await _write_status(kube, _ref(body), body.get("status") or {}, status_patch(status))


async def _snapshot(
    kube: Kube,
    namespace: str,
    children: Children,
    informer: Informer | None = None,
    read_unwanted: bool = True,
) -> tuple[dict[tuple[str, str], dict[str, Any] | None], bool]:
    """The children as they are: from the informer where it has them, else from the server. Returns
    them and whether any came from the informer.

    Without `read_unwanted`, a child the spec does not want (an autoscaler while autoscaling is off,
    the cache PVC without a cache) that the informer has not seen counts as absent, unread. Only a spec
    change makes a child unwanted, and the model's own handlers (create, update, resume: kopf retries
    them until they succeed) read those from the server; an event-started reconcile would otherwise
    spend a GET on each (five of a cheap model's six reads per pod event, half the operator's requests
    while 100 models converge, bench/RESULTS.md), for objects that are almost always absent. One of a
    watched kind that exists after all is in the informer, so it is still deleted (read again first,
    `_apply`); the cache PVC, not watched, is deleted by the spec change's own reconcile."""
    live: dict[tuple[str, str], dict[str, Any] | None] = {}
    cached = False
    wanted = [(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in children.manifests]
    gone = [(ref.api_version, ref.kind, ref.name) for ref in children.absent]
    unread = set() if read_unwanted or informer is None else set(gone)
    for api_version, kind, name in gone + wanted:
        seen = informer.get(api_version, kind, namespace, name) if informer is not None else None
        if seen is not None:
            live[kind, name] = seen
            cached = True
            continue
        if (api_version, kind, name) in unread:
            live[kind, name] = None
            continue
        try:
            live[kind, name] = await kube.get(ObjectRef(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:  # the API itself is missing (KEDA not installed): nothing there
                live[kind, name] = None
                continue
            raise
    return live, cached


async def _execute(kube: Kube, namespace: str, step: Step, logger: Any) -> dict[str, Any] | None:
    ref = ObjectRef(step.api_version, step.kind, namespace, step.name)
    if step.action == Action.DELETE:
        logger.info(f"Deleting {ref.kind} {ref.name}: the spec no longer wants it")
        CHILD_WRITES.labels(ref.kind, "delete").inc()
        await kube.delete(ref)
        return None
    assert step.manifest is not None
    if step.action == Action.HAND_OVER_REPLICAS:
        try:
            await kube.apply(step.manifest, manager=REPLICAS_MANAGER, force=step.force)
        except KubeError as exc:
            if exc.status == 422:
                # The Deployment vanished since its apply (the garbage collector, during a re-created
                # model's hand-over) and the replicas-only body cannot create one: its DELETE event
                # reconciles again.
                return None
            if exc.status != 409:
                raise
            # The autoscaler already owns the replica count: there is nothing to hand over.
        return None
    logger.info(f"Applying {ref.kind} {ref.name}: {', '.join(step.reasons[:5])}")
    CHILD_WRITES.labels(ref.kind, "apply").inc()
    try:
        result = await kube.apply(step.manifest)
        extra = foreign_items(step.manifest, result, others=managed_by_others(result, FIELD_MANAGER))
        if extra:
            # Entries another manager added to a list the operator sets (an env var, a container):
            # the apply kept them, since they are not the operator's fields. Drift: remove them.
            logger.info(f"Removing {len(extra) // 2} entries others added to {ref.kind} {ref.name}")
            CHILD_WRITES.labels(ref.kind, "prune").inc()
            result = await kube.json_patch(ref, extra)
        return result
    except KubeError as exc:
        if exc.status == 404 and ref.kind == "ScaledObject":
            raise _MissingApi(
                ref.kind, "cannot create a keda.sh/v1alpha1 ScaledObject: is KEDA installed?"
            ) from None
        if exc.status == 404 and ref.kind == LWS_KIND:
            raise _MissingApi(ref.kind, LWS_MISSING_MESSAGE) from None
        if exc.status == 404 and ref.kind == POOL_KIND:
            raise _MissingApi(ref.kind, POOL_MISSING_MESSAGE) from None
        if exc.status in (400, 403, 422) and _WEBHOOK_DENIAL.search(exc.message):
            # A policy (an admission webhook: Kyverno, Gatekeeper...) refused it: not the spec's fault
            # (the same spec passes once the policy changes), so no permanent error; retried with
            # back-off, and the status and an Event say which webhook and why while it lasts.
            raise _ApplyFailed(
                ref.kind,
                ref.name,
                "AdmissionDenied",
                f"an admission webhook refused the {ref.kind} {ref.name}: {exc.message}",
            ) from None
        if exc.status in (400, 422) or (exc.status == 500 and _SCHEMA_ERRORS.search(exc.message)):
            # The API server refused what the spec asked for (a pass-through field such as affinity
            # or tolerations is malformed or misspelt, two volumes of one name): a spec problem, not
            # one a retry fixes. Server-side apply answers some of these with 500.
            raise SpecError(
                "RejectedByApiServer", f"the API server refused the {ref.kind}: {exc.message}"
            ) from None
        if exc.status == 403 or exc.status >= 500:
            # Permissions (RBAC, a ResourceQuota, an admission plugin) or the server itself: say so in
            # the status and an Event, keep applying the other children, then retry slowly; never
            # retry silently.
            reason = "Forbidden" if exc.status == 403 else "ApplyFailed"
            raise _ApplyFailed(
                ref.kind,
                ref.name,
                reason,
                f"the API server answered {exc.status} to applying {ref.kind} {ref.name}: {exc.message}",
            ) from None
        raise


_SCHEMA_ERRORS = re.compile(r"field not declared in schema|duplicate entries for key|failed to create typed")
"""What server-side apply answers with a 500 for a body that does not fit the object's schema."""


_WEBHOOK_DENIAL = re.compile(r'admission webhook "[^"]*" denied the request')
"""How the API server words a validating or mutating webhook's refusal (any status code it chose)."""


LWS_MISSING_MESSAGE = (
    f"cannot create a {LWS_API_VERSION} LeaderWorkerSet: is the LeaderWorkerSet controller installed "
    "(sigs.k8s.io/lws)? model.nodes above 1 runs each replica as a LeaderWorkerSet group; install it, "
    "or set model.nodes: 1 to serve from one pod"
)


class _MissingApi(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _AdmissionDenied(kopf.TemporaryError):
    """A child refused by an admission webhook: retried with a back-off of its own (`reconcile`)."""


class _ApplyFailed(Exception):
    def __init__(self, kind: str, name: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.reason = reason
        self.message = message


async def _apply(
    kube: Kube,
    body: Mapping[str, Any],
    children: Children,
    logger: Any,
    overrides: dict[tuple[str, str, str], tuple[str, frozenset[str]]],
    informer: Informer | None = None,
    read_unwanted: bool = True,
    retries: SlowRetries = DEFAULT_RETRIES,
) -> float | None:
    ref = _ref(body)
    live, cached = await _snapshot(kube, ref.namespace, children, informer, read_unwanted)
    hashes = {(m["kind"], m["metadata"]["name"]): applied_hash(m) for m in children.manifests}

    def current_overrides() -> dict[tuple[str, str], frozenset[str]]:
        found = {}
        for (kind, name), digest in hashes.items():
            held = overrides.get((ref.namespace, kind, name))
            if held is not None and held[0] == digest:
                found[kind, name] = held[1]
        return found

    def planned() -> Plan:
        return plan_writes(
            manifests=children.manifests,
            absent=[(c.api_version, c.kind, c.name) for c in children.absent],
            live=live,
            owner_uid=body.get("metadata", {}).get("uid"),
            owner_name=ref.name,
            namespace=ref.namespace,
            initial_replicas=initial_replicas(children.spec),
            overridden=current_overrides(),
        )

    plan = planned()
    if cached and (plan.steps or plan.conflicts):
        # The informer may lag behind the server: never write (or report a conflict) on its word.
        live, _ = await _snapshot(kube, ref.namespace, children)
        plan = planned()
    missing_api: str | None = None
    missing_workload: str | None = None
    missing_pool: str | None = None
    failed: _ApplyFailed | None = None
    unwritable: set[tuple[str, str]] = set()
    for step in plan.steps:
        if (step.kind, step.name) in unwritable:
            continue  # the hand-over of a workload that could not be applied
        try:
            result = await _execute(kube, ref.namespace, step, logger)
        except _MissingApi as exc:
            unwritable.add((step.kind, step.name))
            if exc.kind == LWS_KIND:
                missing_workload = str(exc)  # no pods at all: Ready False, Degraded True, an Event
            elif exc.kind == POOL_KIND:
                missing_pool = str(exc)  # the Service serves; no gateway can route to a pool: Degraded
            else:
                missing_api = str(exc)  # the pods run; only autoscaling is missing
            continue
        except _ApplyFailed as exc:
            unwritable.add((step.kind, step.name))
            ERRORS.labels(exc.reason).inc()
            failed = failed or exc  # the other children are still applied
            continue
        if step.action == Action.DELETE:
            live[step.kind, step.name] = None
        elif step.action == Action.APPLY and result is not None:
            live[step.kind, step.name] = result
            # What admission rewrote of the operator's own values in its own request (a mutating
            # webhook): another apply would only be rewritten again. Remembered for this desired
            # state, reported below, not fought over.
            assert step.manifest is not None
            lost = drift(step.manifest, result, others=managed_by_others(result, FIELD_MANAGER))
            key = (ref.namespace, step.kind, step.name)
            if lost:
                overrides[key] = (str(applied_hash(step.manifest)), frozenset(lost))
            else:
                overrides.pop(key, None)

    def child(kind: str) -> dict[str, Any] | None:
        name = next((m["metadata"]["name"] for m in children.manifests if m["kind"] == kind), None)
        return live.get((kind, name)) if name is not None else None

    pods = informer.pods_of(ref.namespace, ref.name) if informer is not None else None
    if pods is None:
        pods = await kube.list(ObjectRef("v1", "Pod", ref.namespace, ""), children.selector)
    now = datetime.datetime.now(datetime.UTC)
    problems = pod_problems(pods, now)
    problem = problems[0] if problems else None
    conflict = "; ".join(plan.conflicts) if plan.conflicts else None
    workload = children.workload()["kind"]
    if missing_workload is not None and failed is None:
        failed = _ApplyFailed(workload, ref.name, "LeaderWorkerSetApiMissing", missing_workload)
    if missing_pool is not None and failed is None:
        # Degraded True and a Warning Event (`_announce`), Ready as the pods are; retried slowly below,
        # since the CRD may be installed later.
        failed = _ApplyFailed(POOL_KIND, ref.name, "InferencePoolApiMissing", missing_pool)
    kept = current_overrides()
    report: tuple[str, str] | None = (failed.reason, failed.message) if failed else None
    if report is None and kept:
        rewritten = "; ".join(f"{k} {n}: {', '.join(sorted(p))}" for (k, n), p in sorted(kept.items()))
        report = (
            "FieldOverridden",
            f"admission (a mutating webhook) rewrites what carpool sets, on every apply: {rewritten}",
        )

    scaling = children.spec.autoscaling
    previous = body.get("status") or {}
    status = compute_status(
        generation=body.get("metadata", {}).get("generation"),
        previous=previous,
        now=datetime.datetime.now(datetime.UTC),
        deployment=child(workload),
        workload_kind=workload,
        hpa=child("HorizontalPodAutoscaler"),
        scaled_object=child("ScaledObject"),
        autoscaling=scaling.enabled,
        endpoint=children.endpoint,
        selector=children.selector,
        config_hash=children.config_hash,
        pod_problem=(problem.reason, problem.summary(len(pods))) if problem else None,
        conflict=conflict,
        apply_error=report,
    )
    if missing_api is not None:
        for condition in status.conditions:
            if condition.type == ConditionType.AUTOSCALING:
                condition.status = ConditionStatus.FALSE
                condition.reason = "AutoscalerApiMissing"
                condition.message = missing_api
    _announce(body, previous, status)
    await _write_status(kube, ref, previous, status_patch(status))
    if failed is not None and failed.reason == "AdmissionDenied":
        raise _AdmissionDenied(failed.message)
    if missing_workload is not None:
        # The API may appear later (the LeaderWorkerSet controller installed after the operator).
        raise kopf.TemporaryError(missing_workload, delay=retries.missing_api)
    if failed is not None:
        raise kopf.TemporaryError(failed.message, delay=retries.apply_failed)
    if missing_api is not None:
        # The API may appear later (KEDA installed after the operator): retry, but slowly.
        raise kopf.TemporaryError(missing_api, delay=retries.missing_api)
    if conflict is not None:
        # The user may rename or delete the other object; look again later without hammering.
        raise kopf.TemporaryError(conflict, delay=retries.conflict)
    deadline = next_deadline(pods, now)
    if deadline is None or deadline - now > datetime.timedelta(seconds=RECHECK_HORIZON_SECONDS):
        return None
    return (deadline - now).total_seconds() + RECHECK_MARGIN_SECONDS


def _announce(body: Mapping[str, Any], previous: Mapping[str, Any], status: BatchedModelStatus) -> None:
    """A Warning Event when Degraded turns to a new reason or message (not on every reconcile)."""
    degraded = status.condition(ConditionType.DEGRADED)
    if degraded is None or degraded.status != ConditionStatus.TRUE:
        return
    before: Mapping[str, Any] = next(
        (c for c in previous.get("conditions") or [] if c.get("type") == ConditionType.DEGRADED), {}
    )
    if before.get("status") == "True" and (before.get("reason"), before.get("message")) == (
        degraded.reason,
        degraded.message,
    ):
        return
    kopf.warn(kopf.Body(cast(kopf.RawBody, dict(body))), reason=degraded.reason, message=degraded.message)


def _same(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return all(previous.get(key) == value for key, value in new.items())


async def _write_status(kube: Kube, ref: ObjectRef, previous: Mapping[str, Any], new: dict[str, Any]) -> None:
    if not _same(previous, new):
        await kube.patch_status(ref, new)


async def reconcile_owner(state: OperatorState, child: Mapping[str, Any], logger: Any = None) -> None:
    """A child changed (or was deleted): reconcile the BatchedModel of its owner reference's name, if it
    exists and is not being deleted. Its uid may be another one: a model deleted and applied again at
    once, whose predecessor's child the garbage collector just deleted; the new model re-creates it."""
    meta = child.get("metadata", {})
    namespace = meta.get("namespace") or "default"
    for owner in meta.get("ownerReferences") or []:
        if owner.get("kind") != KIND or owner.get("apiVersion") != API_VERSION:
            continue
        await reconcile_named(state, namespace, owner["name"], trigger="child", logger=logger)
        return


async def reconcile_pod_owner(state: OperatorState, pod: Mapping[str, Any], logger: Any = None) -> None:
    """A runtime pod changed: reconcile the BatchedModel its instance label names, so the status
    explains a pod that cannot start (its owner reference names a ReplicaSet, not the model)."""
    meta = pod.get("metadata", {})
    name = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    if name:
        await reconcile_named(state, meta.get("namespace") or "default", name, trigger="pod", logger=logger)


async def reconcile_named(
    state: OperatorState, namespace: str, name: str, *, trigger: str, logger: Any = None
) -> None:
    """Reconcile a BatchedModel for an event that is not its own (a child's, a pod's, a requeue).

    kopf retries only the BatchedModel's own handlers; an event handler that fails is logged and
    forgotten. So a reconcile that must be retried here is requeued (`requeue`), as controller-runtime's
    work queue does: never dropped.
    """
    log = logger or logging.getLogger("carpool.operator")
    try:
        # Read (once, under the lock) by `reconcile`: gone or being deleted, it does nothing (garbage
        # collection removes the children).
        named = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"namespace": namespace, "name": name}}
        await reconcile(
            state,
            named,
            trigger=trigger,
            logger=logger,
            report_spec_errors=False,
            coalesce=True,
            read_unwanted=False,
        )
    except kopf.TemporaryError as exc:
        requeue(state, namespace, name, exc.delay or RETRY_DELAY_SECONDS, log, str(exc))
    except KubeError as exc:  # reading the BatchedModel itself failed
        delay = api_failure(exc, log)
        requeue(state, namespace, name, delay, log, str(exc))


def requeue(
    state: OperatorState,
    namespace: str,
    name: str,
    delay: float,
    logger: Any,
    why: str,
    *,
    quiet: bool = False,
) -> None:
    """Reconcile the BatchedModel again after `delay` seconds, once however many events asked for it
    (`quiet`: a planned look, logged at debug level, not a failure's retry)."""
    key = (namespace, name)
    pending = state.requeued.get(key)
    if pending is not None and not pending.done():
        return
    (logger.debug if quiet else logger.warning)(
        f"Reconcile of {namespace}/{name} requeued in {delay:g} s: {why}"
    )

    async def later() -> None:
        await asyncio.sleep(delay)
        state.requeued.pop(key, None)
        await reconcile_named(state, namespace, name, trigger="requeue", logger=logger)

    state.requeued[key] = asyncio.get_running_loop().create_task(later(), name=f"requeue {namespace}/{name}")
