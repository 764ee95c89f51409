"""What the real controllers do with the operator's objects: the garbage collector on deletion, the
operator restoring a deleted child, the HPA controller reading (or failing to read) the queue metric."""

from __future__ import annotations

import pytest

from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.objects import CHILD_KINDS, batched_model, child_name, kubectl_apply, wait_for_children


@pytest.mark.parametrize("propagation", ["background", "foreground"])
def test_deleting_a_batched_model_lets_the_garbage_collector_remove_every_child(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, propagation: str
) -> None:
    kubectl_apply(admin_env, batched_model("gone", namespace))
    wait_for_children(api, namespace, "gone")
    wait_for("the runtime pod", lambda: api.list("Pod", namespace, "app.kubernetes.io/instance=gone"))
    run(
        "kubectl",
        "delete",
        "bm",
        "gone",
        "-n",
        namespace,
        f"--cascade={propagation}",
        "--wait=false",
        env=admin_env,
    )

    def all_gone() -> bool:
        left = [
            kind for kind in CHILD_KINDS if api.get(kind, namespace, child_name(kind, "gone")) is not None
        ]
        left += ["Pod"] * len(api.list("Pod", namespace, "app.kubernetes.io/instance=gone"))
        left += ["BatchedModel"] if api.get("BatchedModel", namespace, "gone") is not None else []
        if left:
            raise AssertionError(f"still there: {left}")
        return True

    wait_for(f"{propagation} deletion of the BatchedModel and its children", all_gone, timeout=90)


def test_a_child_deleted_by_hand_is_restored(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("kept", namespace))
    children = wait_for_children(api, namespace, "kept")
    for kind in ("Service", "HorizontalPodAutoscaler"):
        old_uid = children[kind]["metadata"]["uid"]
        assert api.delete(kind, namespace, "kept") == 200
        wait_for(
            f"the {kind} restored",
            lambda kind=kind, old_uid=old_uid: (
                (found := api.get(kind, namespace, "kept"))  # type: ignore[misc]
                and found["metadata"]["uid"] != old_uid
            ),
        )


def test_the_hpa_controller_accepts_the_hpa_and_its_missing_metric_reaches_the_status(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    """No custom metrics API is installed here: the real HPA controller says it cannot get
    carpool_queue_depth, and the BatchedModel's Autoscaling condition carries its reason and message."""
    kubectl_apply(admin_env, batched_model("scaled", namespace))
    wait_for_children(api, namespace, "scaled", kinds=("HorizontalPodAutoscaler",))

    def metric_unavailable() -> dict[str, object] | None:
        found = condition(api.get("BatchedModel", namespace, "scaled"), "Autoscaling")
        if found is None or found["reason"] != "FailedGetPodsMetric":
            raise AssertionError(f"Autoscaling is {found}")
        return found

    found = wait_for("the HPA's FailedGetPodsMetric in the status", metric_unavailable, timeout=90)
    assert found["status"] == "False"
    assert "carpool_queue_depth" in str(found["message"]), found
    hpa = api.get("HorizontalPodAutoscaler", namespace, "scaled")
    assert condition(hpa, "AbleToScale") is not None, hpa
