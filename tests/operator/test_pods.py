"""Why pods are not ready, from what the scheduler and the kubelet wrote on them; and the conditions
that carry it."""

from __future__ import annotations

import datetime
from typing import Any

from carpool.operator.status.compute import compute_status
from carpool.operator.status.pods import next_deadline, pod_problem, pod_problems


def pod(name: str = "m-1", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


UNSCHEDULABLE = pod(
    phase="Pending",
    conditions=[
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
        }
    ],
)


def waiting(reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {"name": "runtime", "state": {"waiting": {"reason": reason, "message": message}}, **extra}


def test_unschedulable_carries_the_schedulers_message() -> None:
    assert pod_problem(UNSCHEDULABLE) == (
        "Unschedulable",
        "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
    )


def test_image_pull_errors() -> None:
    for reason in ("ErrImagePull", "ImagePullBackOff"):
        found = pod_problem(pod(containerStatuses=[waiting(reason, 'pull "carpool:0.1.0-cpu": not found')]))
        assert found is not None and found[0] == "ImagePullFailed" and "not found" in found[1]


def test_a_crash_loop_shows_the_termination_message() -> None:
    status = waiting(
        "CrashLoopBackOff",
        "back-off 40s restarting failed container",
        lastState={
            "terminated": {"exitCode": 1, "reason": "Error", "message": "401 Unauthorized: hub token"}
        },
    )
    found = pod_problem(pod(containerStatuses=[status]))
    assert found is not None
    assert found[0] == "CrashLoopBackOff" and "401 Unauthorized" in found[1] and "exit code 1" in found[1]


def test_oom_killed_is_named_and_says_what_to_change() -> None:
    status = waiting("CrashLoopBackOff", lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})
    found = pod_problem(pod(containerStatuses=[status]))
    assert found is not None and found[0] == "OOMKilled" and "limits.memory" in found[1]


def test_a_failing_fetch_init_container_is_a_model_fetch_failure() -> None:
    init = {
        "name": "fetch",
        "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": "repo not found: org/x"}},
    }
    found = pod_problem(pod(initContainerStatuses=[init], containerStatuses=[waiting("PodInitializing")]))
    assert found is not None and found[0] == "ModelFetchFailed" and "org/x" in found[1]


def test_loading_and_warming_up_is_no_problem() -> None:
    running = {"name": "runtime", "ready": False, "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
    assert pod_problem(pod(phase="Running", containerStatuses=[running])) is None
    assert pod_problem(pod(containerStatuses=[waiting("ContainerCreating")])) is None
    assert pod_problems([{**UNSCHEDULABLE, "metadata": {"name": "x", "deletionTimestamp": "now"}}]) == []


def test_problems_are_grouped_and_the_most_blocking_comes_first() -> None:
    crash = pod(
        "m-2", containerStatuses=[waiting("CrashLoopBackOff", lastState={"terminated": {"exitCode": 1}})]
    )
    problems = pod_problems([crash, UNSCHEDULABLE, {**UNSCHEDULABLE, "metadata": {"name": "m-3"}}])
    assert [p.reason for p in problems] == ["Unschedulable", "CrashLoopBackOff"]
    assert problems[0].pods == ["m-1", "m-3"]
    assert problems[0].summary(3).startswith("2 of 3 pods (e.g. m-1)")


def test_a_pod_problem_becomes_ready_false_and_degraded() -> None:
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {"replicas": 1}}
    status = compute_status(
        generation=1,
        previous=None,
        now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        deployment=deployment,
        autoscaling=False,
        pod_problem=("Unschedulable", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
    )
    by_type = {c.type.value: c for c in status.conditions}
    assert by_type["Ready"].status == "False" and by_type["Ready"].reason == "Unschedulable"
    assert by_type["Degraded"].status == "True" and "nvidia.com/gpu" in by_type["Degraded"].message
    assert status.phase == "Degraded"


def test_a_name_conflict_is_a_resource_conflict() -> None:
    status = compute_status(
        generation=1,
        previous=None,
        now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        conflict="Service ml/m already exists and is controlled by Application shop",
    )
    ready = next(c for c in status.conditions if c.type.value == "Ready")
    assert (ready.status, ready.reason) == ("False", "ResourceConflict") and "Service ml/m" in ready.message


def test_an_oom_kill_that_the_container_recovered_from_is_no_longer_a_problem() -> None:
    """The kubelet keeps `lastState` until the next termination: read it only while not ready."""
    oom = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    recovered = {
        "name": "runtime",
        "ready": True,
        "state": {"running": {}},
        "lastState": oom,
        "restartCount": 1,
    }
    assert pod_problem(pod(containerStatuses=[recovered])) is None
    restarting = {**recovered, "ready": False}
    found = pod_problem(pod(containerStatuses=[restarting]))
    assert found is not None and found[0] == "OOMKilled"


NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def on_node(name: str = "m-1", node: str = "gpu-7", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeName": node}, "status": status}


def marked_not_ready_by_the_node_controller() -> dict[str, Any]:
    running = {"name": "runtime", "ready": True, "state": {"running": {}}}
    conditions = [
        {"type": "ContainersReady", "status": "True"},
        {"type": "Ready", "status": "False"},
    ]
    return on_node(phase="Running", conditions=conditions, containerStatuses=[running])


def test_a_pod_the_node_controller_marked_not_ready_names_its_node() -> None:
    found = pod_problem(marked_not_ready_by_the_node_controller())
    assert found is not None and found[0] == "NodeNotReady"
    assert "node gpu-7" in found[1]
    gated = marked_not_ready_by_the_node_controller()
    gated["spec"]["readinessGates"] = [{"conditionType": "example.com/ready"}]
    assert pod_problem(gated) is None  # a readiness gate, not the node
    loading = on_node(
        conditions=[{"type": "ContainersReady", "status": "False"}, {"type": "Ready", "status": "False"}]
    )
    assert pod_problem(loading) is None


def evicted(deleted_at: datetime.datetime) -> dict[str, Any]:
    body = marked_not_ready_by_the_node_controller()
    body["metadata"]["deletionTimestamp"] = deleted_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    body["status"]["conditions"].append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "DeletionByTaintManager",
            "message": "Taint manager: deleting due to NoExecute taint",
        }
    )
    return body


def test_a_deleted_pod_past_its_grace_period_is_stuck_on_its_lost_node() -> None:
    within = evicted(NOW + datetime.timedelta(seconds=5))
    assert pod_problems([within], NOW) == []  # still in its grace period: terminating as it should
    assert pod_problems([within]) == []  # without a clock, never
    (stuck,) = pod_problems([evicted(NOW - datetime.timedelta(seconds=30))], NOW)
    assert stuck.reason == "StuckTerminating"
    assert "node gpu-7" in stuck.message and "DeletionByTaintManager" in stuck.message
    assert "out-of-service" in stuck.message
    # The same message while it lasts (no new Warning Event on every reconcile).
    later = pod_problems([evicted(NOW - datetime.timedelta(seconds=30))], NOW + datetime.timedelta(minutes=5))
    assert later[0].message == stuck.message


def test_the_next_grace_period_end_is_when_to_look_again() -> None:
    soon, later = NOW + datetime.timedelta(seconds=10), NOW + datetime.timedelta(seconds=40)
    assert next_deadline([evicted(later), evicted(soon), on_node()], NOW) == soon
    assert next_deadline([evicted(NOW - datetime.timedelta(seconds=1)), on_node()], NOW) is None


def test_pods_the_replica_set_cannot_create_are_the_ready_reason() -> None:
    """A ResourceQuota, a LimitRange or Pod Security admission refuses the ReplicaSet's pods: the
    Deployment's ReplicaFailure (FailedCreate) is why nothing is ready, not "loading"."""
    message = (
        'pods "m-5d9f-x" is forbidden: exceeded quota: small, requested: requests.cpu=1, '
        "limited: requests.cpu=500m"
    )
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "conditions": [
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}
            ],
        },
    }
    status = compute_status(generation=1, previous=None, now=NOW, deployment=deployment, autoscaling=False)
    by_type = {c.type.value: c for c in status.conditions}
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", "FailedCreate")
    assert "exceeded quota: small" in by_type["Ready"].message
    assert by_type["Degraded"].reason == "FailedCreate"
