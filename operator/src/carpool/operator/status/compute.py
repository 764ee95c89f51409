"""Computes a BatchedModel's status from its live children. Pure: bodies and a clock in, status out.

How each condition is derived:
- Ready: at least one replica passes readiness and all the replicas the Deployment wants are ready.
  For a model split over several nodes the workload is a LeaderWorkerSet: a replica is a group (a
  leader and its workers), ready when all its pods are, and the LeaderWorkerSet's status counts groups
  in the same fields (`replicas`, `readyReplicas`, `updatedReplicas`).
- Progressing: the Deployment has not caught up with its spec yet (new pods starting, old ones going).
- WarmedUp: all ready replicas have finished warm-up. The runtime's readiness probe
  (/v2/health/ready) answers 200 only after the model is loaded *and* warm-up has finished (the same
  moment it sets the `carpool_ready` gauge), so a ready replica is a warmed-up replica and no extra
  metric is needed: WarmedUp is True when every existing replica is ready (readyReplicas == replicas
  > 0), and False with "k of n" while some pod is still loading or warming up.
- Degraded: the Deployment reports a stuck rollout (ProgressDeadlineExceeded) or a replica failure
  (its ReplicaSet's FailedCreate: pods refused by a ResourceQuota, a LimitRange or Pod Security
  admission, with the API server's message), which is also the Ready reason while no replica is ready.
  Fewer ready replicas than wanted alone is Progressing, not Degraded: a pod the autoscaler just added
  spends its startup budget loading and warming up, and a pod that never gets there ends the rollout
  with ProgressDeadlineExceeded (the deadline is set past the startup budget).
- Pod problems (`status.pods`): a pod that cannot become ready (unschedulable, image pull errors,
  crash loops with the runtime's termination message, OOMKilled) makes Degraded True with that reason
  and message, and Ready False with it while no replica is ready: "warming up" is never shown for a
  pod that will not get there.
- Conflicts: a child's name taken by an object this BatchedModel does not own makes Ready False and
  Degraded True with reason `ResourceConflict` and a message naming the object.
- Autoscaling: copied from the autoscaler's own conditions, so an HPA that cannot read the queue
  metric shows up here with the HPA's reason (FailedGetPodsMetric, ...) and message.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from carpool.operator.status.model import (
    BatchedModelStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    Phase,
)

T, F, U = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


def _conditions_of(body: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    if not body:
        return {}
    return {c.get("type", ""): c for c in body.get("status", {}).get("conditions") or []}


def _autoscaling(
    enabled: bool, hpa: Mapping[str, Any] | None, scaled_object: Mapping[str, Any] | None
) -> tuple[ConditionStatus, str, str]:
    if not enabled:
        return F, "Disabled", "autoscaling is off; spec.replicas sets the replica count"
    if hpa is not None:
        conditions = _conditions_of(hpa)
        for kind in ("AbleToScale", "ScalingActive"):
            found = conditions.get(kind)
            if found is not None and found.get("status") == "False":
                return F, found.get("reason") or kind, found.get("message", "")
        active = conditions.get("ScalingActive")
        if active is None:
            return U, "AutoscalerPending", "the HorizontalPodAutoscaler has not reported yet"
        limited = conditions.get("ScalingLimited")
        if limited is not None and limited.get("status") == "True":
            return T, limited.get("reason") or "ScalingLimited", limited.get("message", "")
        return T, active.get("reason") or "ScalingActive", active.get("message", "")
    if scaled_object is not None:
        ready = _conditions_of(scaled_object).get("Ready")
        if ready is None:
            return U, "AutoscalerPending", "the KEDA ScaledObject has not reported yet"
        status = {"True": T, "False": F}.get(str(ready.get("status")), U)
        return status, ready.get("reason") or "ScaledObjectReady", ready.get("message", "")
    return U, "AutoscalerMissing", "the autoscaler has not been created yet"


def compute_status(
    *,
    generation: int | None,
    previous: Mapping[str, Any] | None,
    now: datetime.datetime,
    deployment: Mapping[str, Any] | None = None,
    hpa: Mapping[str, Any] | None = None,
    scaled_object: Mapping[str, Any] | None = None,
    autoscaling: bool = True,
    endpoint: str | None = None,
    selector: str | None = None,
    config_hash: str | None = None,
    spec_error: tuple[str, str] | None = None,
    pod_problem: tuple[str, str] | None = None,
    conflict: str | None = None,
    apply_error: tuple[str, str] | None = None,
    workload_kind: str = "Deployment",
) -> BatchedModelStatus:
    """The status for the observed children. `spec_error` is (reason, message) of a spec that cannot
    work; the children then keep running what they ran before, and the status says so.
    `deployment` is the workload, of `workload_kind`: the Deployment, or the LeaderWorkerSet of a model
    split over several nodes, whose status counts groups (a group is one replica of the model, ready
    when all its pods are) in the same fields."""
    old = BatchedModelStatus.model_validate(previous or {})
    dep_status: Mapping[str, Any] = (deployment or {}).get("status") or {}
    wanted = int((deployment or {}).get("spec", {}).get("replicas", 1)) if deployment else 0
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    dep_generation = (deployment or {}).get("metadata", {}).get("generation")
    observed = dep_status.get("observedGeneration")
    dep_conditions = _conditions_of(deployment)

    conditions: list[tuple[ConditionType, ConditionStatus, str, str]] = []

    stuck = dep_conditions.get("Progressing", {})
    failure = dep_conditions.get("ReplicaFailure", {})
    caught_up = dep_generation is None or observed is None or observed >= dep_generation
    rolling = deployment is not None and (
        not caught_up or updated < wanted or replicas > updated or ready < wanted
    )
    if deployment is None:
        progressing = (T, "Creating", f"the {workload_kind} is being created")
    elif stuck.get("reason") == "ProgressDeadlineExceeded":
        progressing = (F, "ProgressDeadlineExceeded", stuck.get("message", ""))
    elif rolling:
        progressing = (
            T,
            "RollingOut",
            f"{updated} of {wanted} replicas updated, {ready} ready (the rest loading or warming up)",
        )
    else:
        progressing = (F, "RolloutComplete", f"{ready} of {wanted} replicas ready")

    if stuck.get("reason") == "ProgressDeadlineExceeded":
        degraded = (T, "ProgressDeadlineExceeded", stuck.get("message", "the rollout is stuck"))
    elif failure.get("status") == "True":
        degraded = (T, failure.get("reason") or "ReplicaFailure", failure.get("message", ""))
    else:
        degraded = (F, "AsExpected", "")

    if replicas == 0:
        warmed = (F, "NoReplicas", "no replicas are running")
    elif ready == replicas:
        warmed = (T, "AllReplicasWarm", f"all {ready} replicas loaded the model and finished warm-up")
    else:
        warmed = (F, "WarmingUp", f"{ready} of {replicas} replicas finished loading and warm-up")

    if deployment is not None and wanted == 0:
        ready_cond = (
            (F, "ScaledToZero", "scaled to zero; the autoscaler starts a replica on demand")
            if autoscaling
            else (F, "ScaledToZero", "replicas is 0 (autoscaling off): raise replicas to serve")
        )
    elif ready > 0 and ready >= wanted:
        ready_cond = (T, "ReplicasReady", f"{ready} of {wanted} replicas ready at {endpoint}")
    elif ready > 0:
        ready_cond = (T, "PartiallyReady", f"{ready} of {wanted} replicas ready at {endpoint}")
    else:
        ready_cond = (F, "NoReplicaReady", f"0 of {wanted} replicas ready (loading or warming up)")

    if failure.get("status") == "True" and ready == 0 and wanted > 0:
        # The ReplicaSet cannot create pods (a ResourceQuota, a LimitRange, Pod Security admission: its
        # FailedCreate): no replica is coming, so not "loading or warming up".
        ready_cond = (F, failure.get("reason") or "ReplicaFailure", failure.get("message", ""))

    scaling = _autoscaling(autoscaling, hpa, scaled_object)

    if pod_problem is not None and spec_error is None:
        degraded = (T, *pod_problem)
        if ready == 0:
            ready_cond = (F, *pod_problem)
    if conflict is not None and spec_error is None:
        degraded = (T, "ResourceConflict", conflict)
        ready_cond = (F, "ResourceConflict", conflict)
    if apply_error is not None and spec_error is None:
        # A child could not be written (403, 5xx): the pods that run keep serving; say why it is stuck.
        degraded = (T, *apply_error)
        if deployment is None:
            ready_cond = (F, *apply_error)

    if spec_error is not None:
        reason, message = spec_error
        kept = " The children keep running the last valid spec." if deployment is not None else ""
        ready_cond = (F, reason, message + kept)
        degraded = (T, reason, message)
        progressing = (F, reason, "the spec cannot work; change it to continue")
        phase = Phase.FAILED
    elif degraded[0] == T:
        phase = Phase.DEGRADED
    elif deployment is not None and wanted == 0 and replicas == 0:
        phase = Phase.IDLE
    elif ready_cond[0] == T and progressing[0] == F:
        phase = Phase.READY
    elif ready > 0 or (deployment is not None and rolling):
        phase = Phase.PROGRESSING
    else:
        phase = Phase.PENDING

    conditions = [
        (ConditionType.READY, *ready_cond),
        (ConditionType.PROGRESSING, *progressing),
        (ConditionType.WARMED_UP, *warmed),
        (ConditionType.DEGRADED, *degraded),
        (ConditionType.AUTOSCALING, *scaling),
    ]
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    built = []
    for kind, status, reason, message in conditions:
        before = old.condition(kind)
        since = before.last_transition_time if before and before.status == status else stamp
        built.append(
            Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message,
                observed_generation=generation,
                last_transition_time=since,
            )
        )
    return BatchedModelStatus(
        phase=phase,
        replicas=replicas,
        ready_replicas=ready,
        updated_replicas=updated,
        observed_generation=generation,
        endpoint=endpoint or old.endpoint,
        selector=selector or old.selector,
        config_hash=config_hash or old.config_hash,
        conditions=built,
    )


def status_patch(status: BatchedModelStatus) -> dict[str, Any]:
    """The status as JSON for the status subresource."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def api_error_status(
    previous: Mapping[str, Any] | None, now: datetime.datetime, reason: str, message: str
) -> dict[str, Any]:
    """A status patch that keeps the last computed status and sets Degraded=True with an API failure
    (`reason`: the operator's name for it, e.g. Forbidden) until a reconcile gets through again."""
    old = BatchedModelStatus.model_validate(previous or {})
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    before = old.condition(ConditionType.DEGRADED)
    degraded = Condition(
        type=ConditionType.DEGRADED,
        status=T,
        reason=reason,
        message=message,
        observed_generation=before.observed_generation if before else None,
        last_transition_time=before.last_transition_time if before and before.status == T else stamp,
    )
    others = [c for c in old.conditions if c.type != ConditionType.DEGRADED]
    old.conditions = [*others, degraded]
    old.phase = Phase.DEGRADED
    return status_patch(old)
