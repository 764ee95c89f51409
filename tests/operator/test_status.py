"""Status from children: phase and conditions computed from Deployment and autoscaler bodies."""

from __future__ import annotations

import datetime
from typing import Any

from carpool.operator.status.compute import compute_status
from carpool.operator.status.model import BatchedModelStatus, ConditionType, Phase

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)


def deployment(
    wanted: int = 2, replicas: int = 2, ready: int = 2, updated: int | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": wanted},
        "status": {
            "observedGeneration": 3,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            **extra,
        },
    }


def hpa(*conditions: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "status": {
            "conditions": [
                {"type": kind, "status": status, "reason": reason, "message": f"{kind} says {reason}"}
                for kind, status, reason in conditions
            ]
        }
    }


HEALTHY_HPA = hpa(("AbleToScale", "True", "ReadyForNewScale"), ("ScalingActive", "True", "ValidMetricFound"))


def compute(**kwargs: Any) -> BatchedModelStatus:
    args: dict[str, Any] = {"generation": 7, "previous": None, "now": NOW, "endpoint": "http://m.ml.svc:8000"}
    return compute_status(**(args | kwargs))


def state(status: BatchedModelStatus, kind: ConditionType) -> tuple[str, str]:
    condition = status.condition(kind)
    assert condition is not None
    return condition.status.value, condition.reason


def test_all_replicas_ready_is_ready_and_warmed_up() -> None:
    status = compute(deployment=deployment(), hpa=HEALTHY_HPA)
    assert status.phase == Phase.READY
    assert (status.replicas, status.ready_replicas, status.observed_generation) == (2, 2, 7)
    assert state(status, ConditionType.READY) == ("True", "ReplicasReady")
    assert state(status, ConditionType.WARMED_UP) == ("True", "AllReplicasWarm")
    assert state(status, ConditionType.PROGRESSING) == ("False", "RolloutComplete")
    assert state(status, ConditionType.DEGRADED) == ("False", "AsExpected")
    assert state(status, ConditionType.AUTOSCALING) == ("True", "ValidMetricFound")
    assert all(c.observed_generation == 7 for c in status.conditions)


def test_a_replica_still_warming_up_keeps_warmed_up_false() -> None:
    status = compute(deployment=deployment(wanted=3, replicas=3, ready=2), hpa=HEALTHY_HPA)
    assert status.phase == Phase.PROGRESSING
    assert state(status, ConditionType.WARMED_UP) == ("False", "WarmingUp")
    assert "2 of 3" in (status.condition(ConditionType.WARMED_UP) or status.conditions[0]).message
    assert state(status, ConditionType.READY) == ("True", "PartiallyReady")
    assert state(status, ConditionType.PROGRESSING) == ("True", "RollingOut")


def test_new_model_with_no_ready_pod_is_pending() -> None:
    status = compute(deployment=deployment(wanted=1, replicas=1, ready=0))
    assert state(status, ConditionType.READY) == ("False", "NoReplicaReady")
    assert status.phase == Phase.PROGRESSING
    assert compute().phase == Phase.PENDING


def test_hpa_that_cannot_read_the_metric_shows_its_reason() -> None:
    broken = hpa(
        ("AbleToScale", "True", "SucceededGetScale"), ("ScalingActive", "False", "FailedGetPodsMetric")
    )
    status = compute(deployment=deployment(), hpa=broken)
    assert state(status, ConditionType.AUTOSCALING) == ("False", "FailedGetPodsMetric")
    assert (status.condition(ConditionType.AUTOSCALING) or status.conditions[0]).message == (
        "ScalingActive says FailedGetPodsMetric"
    )
    assert state(compute(deployment=deployment(), hpa={}), ConditionType.AUTOSCALING)[0] == "Unknown"
    assert state(compute(deployment=deployment(), autoscaling=False), ConditionType.AUTOSCALING) == (
        "False",
        "Disabled",
    )


def test_keda_ready_condition_is_copied() -> None:
    scaled = {
        "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "ScaledObjectCheckFailed"}]}
    }
    status = compute(deployment=deployment(), scaled_object=scaled)
    assert state(status, ConditionType.AUTOSCALING) == ("False", "ScaledObjectCheckFailed")


def test_stuck_rollout_is_degraded() -> None:
    stuck = deployment(
        wanted=2,
        replicas=3,
        ready=2,
        updated=1,
        conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}],
    )
    status = compute(deployment=stuck)
    assert status.phase == Phase.DEGRADED
    assert state(status, ConditionType.DEGRADED) == ("True", "ProgressDeadlineExceeded")


def test_a_replica_added_by_the_autoscaler_is_progress_not_degradation() -> None:
    status = compute(deployment=deployment(wanted=3, replicas=3, ready=2, updated=3), hpa=HEALTHY_HPA)
    assert state(status, ConditionType.PROGRESSING) == ("True", "RollingOut")
    assert state(status, ConditionType.DEGRADED) == ("False", "AsExpected")


def test_scaled_to_zero_is_idle() -> None:
    status = compute(deployment=deployment(wanted=0, replicas=0, ready=0))
    assert status.phase == Phase.IDLE
    assert state(status, ConditionType.READY) == ("False", "ScaledToZero")
    assert state(status, ConditionType.WARMED_UP) == ("False", "NoReplicas")


def test_spec_error_fails_the_model_but_keeps_what_runs() -> None:
    status = compute(deployment=deployment(), spec_error=("UnsupportedModelSource", "use pkg: or hf:"))
    assert status.phase == Phase.FAILED
    assert state(status, ConditionType.READY) == ("False", "UnsupportedModelSource")
    assert state(status, ConditionType.DEGRADED) == ("True", "UnsupportedModelSource")
    assert "keep running" in (status.condition(ConditionType.READY) or status.conditions[0]).message


def test_transition_times_move_only_when_a_status_changes() -> None:
    first = compute(deployment=deployment(wanted=2, replicas=2, ready=1), hpa=HEALTHY_HPA)
    previous = first.model_dump(mode="json", by_alias=True)
    second = compute(deployment=deployment(), hpa=HEALTHY_HPA, previous=previous, now=LATER)
    times = {c.type: c.last_transition_time for c in second.conditions}
    assert times[ConditionType.AUTOSCALING] == "2026-01-01T12:00:00Z"  # unchanged
    assert times[ConditionType.WARMED_UP] == "2026-01-01T12:05:00Z"  # False -> True
