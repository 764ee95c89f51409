"""The reconciler's write plan: ownership, deletions before applies, the replica hand-over."""

from __future__ import annotations

import copy
from typing import Any

from carpool.operator.plan import REPLICAS_MANAGER, Action, Plan, plan_writes
from carpool.operator.resources import build_children, initial_replicas
from tests.operator.factories import batched_model

Live = dict[tuple[str, str], dict[str, Any] | None]


def plan_for(spec: dict[str, Any] | None, live: Live, uid: str = "uid-m", name: str = "m") -> Plan:
    children = build_children(batched_model(name, spec, uid=uid))
    return plan_writes(
        manifests=children.manifests,
        absent=[(c.api_version, c.kind, c.name) for c in children.absent],
        live=live,
        owner_uid=uid,
        namespace="ml",
        initial_replicas=initial_replicas(children.spec),
        owner_name=name,
    )


def applied(spec: dict[str, Any] | None, replicas: int | None = None) -> Live:
    """The live children after the operator applied `spec` (the autoscaler set `replicas`)."""
    live: Live = {}
    for manifest in build_children(batched_model("m", spec)).manifests:
        live[manifest["kind"], manifest["metadata"]["name"]] = copy.deepcopy(manifest)
    if replicas is not None:
        deployment = live["Deployment", "m"]
        assert deployment is not None
        deployment["spec"]["replicas"] = replicas
    return live


def actions(plan: Plan) -> list[tuple[str, str]]:
    return [(step.action.value, step.kind) for step in plan.steps]


def test_a_new_model_creates_its_deployment_at_the_minimum_and_hands_the_count_over() -> None:
    plan = plan_for({"autoscaling": {"minReplicas": 3, "maxReplicas": 5}}, {})
    deployment = [s for s in plan.steps if s.kind == "Deployment"]
    assert [s.action for s in deployment] == [Action.APPLY, Action.HAND_OVER_REPLICAS]
    assert deployment[0].manifest is not None and deployment[0].manifest["spec"]["replicas"] == 3
    hand_over = deployment[1].manifest
    assert hand_over is not None and hand_over["spec"] == {"replicas": 3}
    assert REPLICAS_MANAGER != "carpool-operator"


def test_nothing_is_written_when_nothing_changed() -> None:
    assert plan_for(None, applied(None, replicas=7)).steps == []


def test_hpa_to_keda_deletes_the_hpa_before_applying_the_scaled_object() -> None:
    plan = plan_for({"autoscaling": {"engine": "keda"}}, applied(None))
    order = actions(plan)
    assert order.index(("delete", "HorizontalPodAutoscaler")) < order.index(("apply", "ScaledObject"))
    assert order[0] == ("delete", "HorizontalPodAutoscaler")


def test_keda_to_hpa_deletes_the_scaled_object_first() -> None:
    plan = plan_for(None, applied({"autoscaling": {"engine": "keda"}}))
    order = actions(plan)
    assert order[0] == ("delete", "ScaledObject")
    assert ("apply", "HorizontalPodAutoscaler") in order


def test_autoscaling_off_deletes_the_scaler_before_the_deployment_gets_its_count() -> None:
    plan = plan_for({"autoscaling": {"enabled": False}, "replicas": 2}, applied(None, replicas=6))
    order = actions(plan)
    assert order[0] == ("delete", "HorizontalPodAutoscaler")
    step = next(s for s in plan.steps if s.kind == "Deployment")
    assert step.manifest is not None and step.manifest["spec"]["replicas"] == 2
    assert ("hand-over-replicas", "Deployment") not in order


def test_autoscaling_on_keeps_the_current_count_until_the_scaler_writes() -> None:
    live = applied({"autoscaling": {"enabled": False}, "replicas": 6})
    plan = plan_for(None, live)
    deployment = [s for s in plan.steps if s.kind == "Deployment"]
    # The count is co-owned by the hand-over manager first, then the operator's apply drops it.
    assert [s.action for s in deployment] == [Action.HAND_OVER_REPLICAS, Action.APPLY]
    assert deployment[0].manifest is not None and deployment[0].manifest["spec"] == {"replicas": 6}
    assert deployment[1].manifest is not None and "replicas" not in deployment[1].manifest["spec"]
    order = actions(plan)
    assert order.index(("apply", "Deployment")) < order.index(("apply", "HorizontalPodAutoscaler"))


def test_an_object_carpool_does_not_own_is_never_applied_or_deleted() -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "m",
            "ownerReferences": [{"kind": "Application", "name": "shop", "controller": True}],
        },
    }
    live = applied(None)
    live["Service", "m"] = foreign
    live["PodDisruptionBudget", "m"] = {"metadata": {"name": "m"}}  # someone else's, no longer wanted
    plan = plan_for({"disruptionBudget": {"enabled": False}, "service": {"port": 80}}, live)
    assert ("apply", "Service") not in actions(plan)
    assert ("delete", "PodDisruptionBudget") not in actions(plan)
    (message,) = plan.conflicts
    assert "Service ml/m" in message and "Application shop" in message


def test_a_re_created_model_takes_over_its_predecessors_children_in_one_plan() -> None:
    """Deleted with --wait=false and applied again: the children still name the old uid."""
    live = applied(None)
    plan = plan_for(None, live, uid="uid-new")
    assert plan.conflicts == []
    taken = {s.kind for s in plan.steps if s.action == Action.APPLY}
    assert taken == {kind for kind, _ in live}
    for step in plan.steps:
        assert step.manifest is not None
        if step.action == Action.APPLY:
            (ref,) = step.manifest["metadata"]["ownerReferences"]
            assert ref["uid"] == "uid-new"
            assert "taken over from a deleted BatchedModel of this name (uid uid-m)" in step.reasons[0]


def test_a_predecessors_child_the_spec_no_longer_wants_is_deleted() -> None:
    live = applied(None)  # with an HPA
    plan = plan_for({"autoscaling": {"enabled": False}}, live, uid="uid-new")
    assert ("delete", "HorizontalPodAutoscaler") in actions(plan)


def test_a_child_of_a_batchedmodel_of_another_name_is_still_a_conflict() -> None:
    """Only a predecessor of the same name is known to be gone; a model of another name may live."""
    live = applied(None)
    live_named: Live = {
        (m["kind"], m["metadata"]["name"]): live[m["kind"], m["metadata"]["name"].replace("m2", "m", 1)]
        for m in build_children(batched_model("m2")).manifests
    }
    plan = plan_for(None, live_named, uid="uid-new", name="m2")
    assert plan.steps == []
    assert len(plan.conflicts) == len(live)
    assert all("controlled by BatchedModel m" in message for message in plan.conflicts)


def test_the_hand_over_to_an_hpa_raises_a_count_of_zero_to_the_minimum_taking_the_field() -> None:
    """The HPA controller never scales a Deployment at 0 replicas ("ScalingDisabled")."""
    live = applied({"autoscaling": {"enabled": False}, "replicas": 0})
    plan = plan_for({"autoscaling": {"minReplicas": 2}}, live)
    hand_over = next(s for s in plan.steps if s.action == Action.HAND_OVER_REPLICAS)
    assert hand_over.manifest is not None and hand_over.manifest["spec"] == {"replicas": 2}
    assert hand_over.force


def test_keda_takes_over_a_count_of_zero_as_it_is() -> None:
    """KEDA activates from zero itself: a Deployment at 0 is handed to it at 0, without force."""
    live = applied({"autoscaling": {"enabled": False}, "replicas": 0})
    keda = {"engine": "keda", "minReplicas": 0, "keda": {"query": "sum(carpool_queue_depth)"}}
    plan = plan_for({"autoscaling": keda}, live)
    hand_over = next(s for s in plan.steps if s.action == Action.HAND_OVER_REPLICAS)
    assert hand_over.manifest is not None and hand_over.manifest["spec"] == {"replicas": 0}
    assert not hand_over.force
