"""`spec.routing: inferencePool`: the InferencePool the operator builds (pure), and what the real operator
does with it against kmock: creates it owned by the model, deletes it when routing goes back to the
Service, and on a cluster without the InferencePool CRD (kmock does not serve it there) says so in the
status and an Event while the rest of the model is served.

The real EPP reading this pool, with the real API server validating it against the upstream CRD, is
tests/cluster/test_endpoint_picker.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from carpool.operator.resources import ChildRef, build_children
from carpool.operator.validation import SpecError
from tests.operator.factories import Cluster, batched_model, two_nodes

POOL_RESOURCE = "inference.networking.k8s.io/v1/inferencepools"
ROUTED = {"routing": "inferencePool"}


def _kinds(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in build_children(body).manifests}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_the_pool_selects_the_model_pods_on_the_port_they_serve_and_names_its_picker() -> None:
    children = _kinds(batched_model("llama", {"model": {"task": "generate"}, **ROUTED}))
    pool = children["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "llama"
    (owner,) = pool["metadata"]["ownerReferences"]
    assert owner["kind"] == "BatchedModel" and owner["controller"] is True
    selector = pool["spec"]["selector"]["matchLabels"]
    template = children["Deployment"]["spec"]["template"]
    assert _matches(selector, template["metadata"]["labels"])
    assert _matches(selector, children["Service"]["spec"]["selector"])
    ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000] and 8000 in ports
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def test_the_pool_of_a_model_over_several_nodes_selects_the_group_leaders_only() -> None:
    children = _kinds(batched_model("llama", {**two_nodes(), **ROUTED}))
    selector = children["InferencePool"]["spec"]["selector"]["matchLabels"]
    templates = children["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert _matches(selector, templates["leaderTemplate"]["metadata"]["labels"])
    assert not _matches(selector, templates["workerTemplate"]["metadata"]["labels"])


def test_without_routing_there_is_no_pool_and_an_old_one_is_removed() -> None:
    children = build_children(batched_model("llama", {"model": {"task": "generate"}}))
    assert all(m["kind"] != "InferencePool" for m in children.manifests)
    assert ChildRef("inference.networking.k8s.io/v1", "InferencePool", "llama") in children.absent


def test_the_network_policy_lets_the_picker_scrape_the_metrics_port() -> None:
    routed = _kinds(batched_model("llama", {"model": {"task": "generate"}, **ROUTED}))
    rules = routed["NetworkPolicy"]["spec"]["ingress"]
    picker = {"podSelector": {"matchLabels": {"inferencepool": "llama-epp"}}}
    (rule,) = [r for r in rules if picker in r.get("from", [])]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    tls = _kinds(batched_model("llama", {"tls": {"secretName": "cert"}, **ROUTED}))
    (rule,) = [r for r in tls["NetworkPolicy"]["spec"]["ingress"] if picker in r.get("from", [])]
    assert rule["ports"] == [{"port": 9090, "protocol": "TCP"}]  # /metrics moves off the TLS port
    plain = _kinds(batched_model("llama", {"model": {"task": "generate"}}))
    assert all(picker not in r.get("from", []) for r in plain["NetworkPolicy"]["spec"]["ingress"])


def test_an_unknown_routing_is_refused_naming_the_choices() -> None:
    with pytest.raises(SpecError) as refused:
        build_children(batched_model("llama", {"routing": "gateway"}))
    assert "routing" in refused.value.message and "inferencePool" in refused.value.message


async def test_the_operator_creates_the_pool_and_deletes_it_when_routing_goes_back(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", {"model": {"task": "generate"}, **ROUTED}))
    pool = await cluster.child("InferencePool", "llama")
    (owner,) = pool["metadata"]["ownerReferences"]
    assert owner["kind"] == "BatchedModel" and owner["name"] == "llama"
    await cluster.patch(
        "BatchedModel", "llama", {"metadata": {"generation": 2}, "spec": {"routing": "service"}}
    )

    async def deleted() -> bool:
        return await cluster.get("InferencePool", "llama") is None

    await cluster.wait_for(deleted, what="the InferencePool deleted")
    await cluster.child("Deployment", "llama")


@pytest.mark.parametrize("missing_apis", [(POOL_RESOURCE,)])
async def test_without_the_inference_pool_crd_the_status_and_an_event_say_so(cluster: Cluster) -> None:
    await cluster.create(batched_model("llama", {"model": {"task": "generate"}, **ROUTED}))

    async def degraded() -> dict[str, Any] | None:
        condition = await cluster.condition("llama", "Degraded")
        return condition if condition and condition["reason"] == "InferencePoolApiMissing" else None

    condition = await cluster.wait_for(degraded, what="Degraded naming the missing InferencePool API")
    assert condition["status"] == "True"
    assert "inferencepools.inference.networking.k8s.io" in condition["message"]
    assert "spec.routing: service" in condition["message"]
    ready = await cluster.condition("llama", "Ready")
    assert ready is not None and ready["reason"] != "InferencePoolApiMissing"  # the pods' own readiness

    async def event() -> dict[str, Any] | None:
        for item in await cluster.list("Event"):
            if item.get("reason") == "InferencePoolApiMissing":
                return item
        return None

    posted = await cluster.wait_for(event, what="a Warning event")
    assert posted["type"] == "Warning" and posted["involvedObject"]["name"] == "llama"
    # Everything else is there: the Service serves the model without the pool.
    await cluster.child("Deployment", "llama")
    await cluster.child("Service", "llama")


@pytest.mark.parametrize("missing_apis", [(POOL_RESOURCE,)])
@pytest.mark.parametrize("slow_retry_s", [1.0])
async def test_a_missing_api_is_tried_again_every_slow_retry_period(
    cluster: Cluster, slow_retry_s: float
) -> None:
    """`--slow-retry-period` sets how often a model waiting for an API is tried again on its own (60 s by
    default: no retry at all in this window)."""
    applies = cluster.kmock[f"patch /apis/{POOL_RESOURCE.replace('/v1/', '/v1/namespaces/ml/')}/llama"]
    await cluster.create(batched_model("llama", {"model": {"task": "generate"}, **ROUTED}))

    async def degraded() -> dict[str, Any] | None:
        condition = await cluster.condition("llama", "Degraded")
        return condition if condition and condition["reason"] == "InferencePoolApiMissing" else None

    await cluster.wait_for(degraded, what="Degraded naming the missing InferencePool API")
    # The other children's creation events reconcile the model (each tries the pool) within the first
    # second or two; what comes after is the retries' doing.
    await asyncio.sleep(2 * slow_retry_s)  # the window under test starts here: not a wait for a state
    before = len(list(applies))
    await cluster.wait_for(
        lambda: len(list(applies)) - before >= 2,
        within=3 * slow_retry_s,
        what="two tries of the pool within three slow retry periods",
    )
