"""`autoscaling.target`: a latency objective beside queue depth, rendered for the HPA and KEDA and into
the runtime's config (pure builders, no cluster)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from carpool.operator.resources import build_children
from carpool.operator.validation import SpecError
from tests.operator.factories import batched_model
from tests.operator.test_crd import failed_rules

LATENCY = {"target": {"latency": {"percentile": 99, "seconds": 0.1}}}


def children_of(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in build_children(batched_model("m", spec)).manifests}


def test_hpa_holds_the_saturation_of_each_pod_under_one_within_its_tolerance() -> None:
    """1 is the objective; the HPA acts only outside 10% around its target, so it holds 0.9."""
    children = children_of({"autoscaling": LATENCY | {"maxReplicas": 6}})
    assert children["HorizontalPodAutoscaler"]["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "carpool_slo_saturation"},
                "target": {"type": "AverageValue", "averageValue": "900m"},
            },
        }
    ]
    # The pods get the objective they compute the signal against.
    runtime = yaml.safe_load(children["ConfigMap"]["data"]["runtime.yaml"])
    assert runtime["objective"] == {"latency_s": 0.1, "percentile": 99.0}


def test_requests_past_the_objective_yield_unless_the_spec_keeps_them_in_order() -> None:
    """The runtime's default (`objective.late_requests: yield`) is not written; `FIFO` is."""
    fifo = {"target": {"latency": {"seconds": 0.1, "lateRequests": "FIFO"}}}
    runtime = yaml.safe_load(children_of({"autoscaling": fifo})["ConfigMap"]["data"]["runtime.yaml"])
    assert runtime["objective"] == {"latency_s": 0.1, "late_requests": "fifo"}
    with pytest.raises(SpecError) as caught:
        build_children(
            batched_model(
                "m", {"autoscaling": {"target": {"latency": {"seconds": 1, "lateRequests": "LIFO"}}}}
            )
        )
    assert "lateRequests" in caught.value.message


def test_keda_sums_the_saturation_against_the_same_threshold() -> None:
    children = children_of({"model": {"name": "mini"}, "autoscaling": LATENCY | {"engine": "keda"}})
    trigger = children["ScaledObject"]["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == 'sum(carpool_slo_saturation{namespace="ml",model="mini"})'
    assert trigger["metadata"]["threshold"] == "0.9"


def test_queue_depth_as_a_target_is_targetQueueDepth() -> None:
    hpa = children_of({"autoscaling": {"target": {"queueDepth": 2.5}}})["HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]["pods"]
    assert metric == {
        "metric": {"name": "carpool_queue_depth"},
        "target": {"type": "AverageValue", "averageValue": "2500m"},
    }
    runtime = yaml.safe_load(children_of({})["ConfigMap"]["data"]["runtime.yaml"])
    assert "objective" not in runtime  # no objective, no signal


@pytest.mark.parametrize(
    ("autoscaling", "words"),
    [
        (LATENCY | {"targetQueueDepth": 4}, "not both"),
        ({"target": {}}, "exactly one of latency and queueDepth"),
        ({"target": {"queueDepth": 2, "latency": {"seconds": 1}}}, "exactly one of latency and queueDepth"),
        ({"target": {"latency": {"percentile": 90}}}, "seconds"),
        ({"target": {"latency": {"seconds": 0.5, "percentile": 100}}}, "percentile"),
    ],
)
def test_a_target_that_cannot_work_is_refused(autoscaling: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as caught:
        build_children(batched_model("m", {"autoscaling": autoscaling}))
    assert caught.value.reason == "InvalidSpec"
    assert words in caught.value.message


def test_a_latency_target_on_vllms_engine_scales_on_the_signal_its_pods_compute() -> None:
    """vLLM's engine exports `carpool_slo_saturation` too (fitted to vLLM's steps: tests/runtime/
    test_vllm_core.py, tests/vllm/test_metrics.py): its HPA holds it, and its pods get the objective."""
    spec = {"model": {"source": "org/llm", "task": "generate", "engine": "vllm"}, "autoscaling": LATENCY}
    children = children_of(spec)
    (metric,) = children["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "carpool_slo_saturation"
    runtime = yaml.safe_load(children["ConfigMap"]["data"]["runtime.yaml"])
    assert runtime["model"]["engine"] == "vllm"
    assert runtime["objective"] == {"latency_s": 0.1, "percentile": 99.0}


def test_the_crds_rules_refuse_two_targets() -> None:
    failed = failed_rules({"autoscaling": LATENCY | {"targetQueueDepth": 4}})
    assert failed and any("targetQueueDepth" in rule for rule in failed)
    failed = failed_rules({"autoscaling": {"target": {"queueDepth": 2, "latency": {"seconds": 1}}}})
    assert failed and any("queueDepth" in rule for rule in failed)
    assert not failed_rules({"autoscaling": LATENCY})
