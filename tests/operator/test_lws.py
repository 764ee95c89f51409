"""Models larger than one GPU: tensor parallelism in one pod, and a LeaderWorkerSet of pods per replica.

Pure: the builders, the spec's checks (pydantic and the CRD's CEL rules), the write plan and the status
computed from a LeaderWorkerSet. What the operator sends to a server is in test_lws_handlers.py (kmock);
what the real LeaderWorkerSet controller makes of it, in tests/cluster/test_lws.py.
"""

from __future__ import annotations

import datetime
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel

from carpool.operator.crd import build_crd
from carpool.operator.plan import Action
from carpool.operator.resources import build_children
from carpool.operator.resources.volumes import PARALLEL_SHM_SIZE
from carpool.operator.spec_pods import MULTI_NODE_NAME_MAX_LENGTH
from carpool.operator.status.compute import compute_status
from carpool.operator.status.model import ConditionType, Phase
from carpool.operator.validation import SpecError
from carpool.runtime.config import RuntimeConfig
from tests.operator.factories import batched_model, two_nodes
from tests.operator.test_crd import failed_rules
from tests.operator.test_plan import Live, actions, plan_for

GPU = "nvidia.com/gpu"
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def crd_rules() -> list[dict[str, str]]:
    """The CEL rules at the root of the BatchedModel schema (they see metadata.name)."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules: list[dict[str, str]] = schema["x-kubernetes-validations"]
    return rules


def llm(**model: Any) -> dict[str, Any]:
    return {"source": "org/llm", "task": "generate", "engine": "vllm", **model}


def kinds(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in build_children(batched_model("m", spec)).manifests}


def container(template: dict[str, Any]) -> dict[str, Any]:
    (runtime,) = template["spec"]["containers"]
    return dict(runtime)


def env(template: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(template)["env"]}


def rendered_config(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    text = manifests["ConfigMap"]["data"]["runtime.yaml"]
    data: dict[str, Any] = yaml.safe_load(text)
    return data


# --- one pod, several GPUs --------------------------------------------------------------------------


def test_tensor_parallel_in_one_pod_is_a_deployment_with_the_gpus_and_shared_memory() -> None:
    manifests = kinds({"model": llm(tensorParallelSize=8), "resources": {"limits": {GPU: 8}}})
    assert "LeaderWorkerSet" not in manifests
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    assert container(manifests["Deployment"]["spec"]["template"])["resources"]["limits"][GPU] == "8"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": PARALLEL_SHM_SIZE}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(
        manifests["Deployment"]["spec"]["template"]
    )["volumeMounts"]
    model = rendered_config(manifests)["model"]
    assert (model["engine"], model["tensor_parallel_size"]) == ("vllm", 8)
    assert RuntimeConfig.model_validate(rendered_config(manifests)).model.tensor_parallel_size == 8


def test_a_stated_shm_size_wins_over_the_parallel_default() -> None:
    manifests = kinds(
        {"model": llm(tensorParallelSize=2), "resources": {"limits": {GPU: 2}}, "shmSize": "2Gi"}
    )
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "2Gi"


def test_a_model_on_one_device_keeps_the_runtimes_shm() -> None:
    pod = kinds({"model": llm()})["Deployment"]["spec"]["template"]["spec"]
    assert all(v["name"] != "dshm" for v in pod["volumes"])


@pytest.mark.parametrize(
    ("model", "gpus", "needed"),
    [
        (llm(tensorParallelSize=8), 1, 8),  # the default resources: one GPU
        (llm(tensorParallelSize=4), 8, 4),  # more GPUs than ranks would idle
        (llm(tensorParallelSize=8, pipelineParallelSize=2, nodes=2), 16, 8),  # per pod, not per group
    ],
)
def test_gpus_per_pod_must_match_the_ranks_per_pod(model: dict[str, Any], gpus: int, needed: int) -> None:
    with pytest.raises(SpecError) as caught:
        build_children(batched_model("m", {"model": model, "resources": {"limits": {GPU: gpus}}}))
    assert caught.value.reason == "ParallelismMismatch"
    assert f"needs {needed} {GPU} per pod, but resources ask for {gpus}" in caught.value.message


# --- several nodes: a LeaderWorkerSet ---------------------------------------------------------------


def test_a_model_over_two_nodes_is_a_leader_worker_set_of_groups_of_two() -> None:
    children = build_children(batched_model("m", two_nodes()))
    manifests = {m["kind"]: m for m in children.manifests}
    assert "Deployment" not in manifests
    assert ("apps/v1", "Deployment", "m") in {(c.api_version, c.kind, c.name) for c in children.absent}
    lws = manifests["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    # Not `m`: the LWS controller names a headless Service after its LeaderWorkerSet, and `m` is the
    # model's own Service.
    assert lws["metadata"]["name"] == "m-lws" != manifests["Service"]["metadata"]["name"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    # vLLM's collective cannot lose a rank and go on: a failed pod restarts its whole group.
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert "replicas" not in lws["spec"]  # the autoscaler owns the group count
    for role in ("leaderTemplate", "workerTemplate"):
        pod = template[role]
        assert container(pod)["resources"]["limits"][GPU] == "8"
        assert env(pod)["CARPOOL_MODEL__NODE_RANK"] == "$(LWS_WORKER_INDEX)"
        assert any(v["name"] == "dshm" for v in pod["spec"]["volumes"])
        assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "m"
    model = rendered_config(manifests)["model"]
    assert (model["nodes"], model["pipeline_parallel_size"], model["tensor_parallel_size"]) == (2, 2, 8)
    assert "node_rank" not in model  # per pod, from the group


def test_only_the_leader_serves_the_api_and_metrics_but_workers_answer_probes_for_the_group() -> None:
    template = kinds(two_nodes())["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"]["carpool.dev/role"] == "leader"
    assert worker["metadata"]["labels"]["carpool.dev/role"] == "worker"
    assert leader["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    assert {p["name"] for p in container(leader)["ports"]} == {"http", "grpc"}
    # The worker's health endpoints (carpool.runtime.vllm.group): ready only while its leader is, live while
    # its ranks run; the same preStop pause, so both pods get SIGTERM together and the worker then waits
    # for its leader to drain.
    assert [p["name"] for p in container(worker)["ports"]] == ["http"]
    for key in ("readinessProbe", "startupProbe", "livenessProbe", "lifecycle"):
        assert container(worker)[key] == container(leader)[key], key
    assert container(worker)["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container(worker)["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert worker["spec"]["terminationGracePeriodSeconds"] == leader["spec"]["terminationGracePeriodSeconds"]


def test_one_disruption_budget_over_every_group_takes_one_group_at_a_time() -> None:
    manifests = kinds(two_nodes())
    budgets = [m for m in manifests.values() if m["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == 1
    (budget,) = budgets
    assert budget["spec"]["maxUnavailable"] == 1
    template = manifests["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    selector = budget["spec"]["selector"]["matchLabels"]
    for role in ("leaderTemplate", "workerTemplate"):  # leaders and workers of every group
        labels = template[role]["metadata"]["labels"]
        assert selector.items() <= labels.items(), role
    assert not any(key.startswith("leaderworkerset.sigs.k8s.io/") for key in selector)


def test_the_service_selects_the_leaders_only() -> None:
    selector = kinds(two_nodes())["Service"]["spec"]["selector"]
    assert selector["carpool.dev/role"] == "leader"
    assert selector["app.kubernetes.io/instance"] == "m"
    assert "carpool.dev/role" not in kinds({})["Service"]["spec"]["selector"]


@pytest.mark.parametrize("engine", ["hpa", "keda"])
def test_the_autoscaler_scales_whole_groups_through_the_leader_worker_set(engine: str) -> None:
    manifests = kinds(two_nodes(autoscaling={"engine": engine, "maxReplicas": 3}))
    scaler = manifests["HorizontalPodAutoscaler" if engine == "hpa" else "ScaledObject"]
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "m-lws",
    }


def test_a_rollout_replaces_whole_groups_with_the_deployments_rules() -> None:
    rollout = kinds(two_nodes())["LeaderWorkerSet"]["spec"]["rolloutStrategy"]
    assert rollout == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1},
    }
    custom = kinds(two_nodes(rollout={"maxSurge": 1, "maxUnavailable": 0}))["LeaderWorkerSet"]["spec"]
    assert custom["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_with_autoscaling_off_the_replicas_are_groups() -> None:
    lws = kinds(two_nodes(autoscaling={"enabled": False}, replicas=3))["LeaderWorkerSet"]
    assert lws["spec"]["replicas"] == 3


def test_the_group_reaches_itself_on_any_port() -> None:
    policy = kinds(two_nodes())["NetworkPolicy"]["spec"]
    group = {"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}
    assert {"from": [group]} in policy["ingress"]  # no `ports`: every port
    assert {"from": [group]} not in kinds({})["NetworkPolicy"]["spec"]["ingress"]


def test_a_new_leader_worker_set_starts_at_the_minimum_and_hands_the_count_over() -> None:
    plan = plan_for(two_nodes(autoscaling={"minReplicas": 2, "maxReplicas": 4}), {})
    steps = [s for s in plan.steps if s.kind == "LeaderWorkerSet"]
    assert [s.action for s in steps] == [Action.APPLY, Action.HAND_OVER_REPLICAS]
    assert steps[0].manifest is not None and steps[0].manifest["spec"]["replicas"] == 2


def test_going_from_one_node_to_two_deletes_the_deployment_first() -> None:
    live: Live = {("Deployment", "m"): kinds({})["Deployment"]}
    plan = plan_for(two_nodes(), live)
    assert actions(plan)[0] == ("delete", "Deployment")
    assert ("apply", "LeaderWorkerSet") in actions(plan)


# --- what the spec refuses --------------------------------------------------------------------------


def test_a_multi_node_models_name_leaves_room_for_its_groups_pods() -> None:
    rule = next(r for r in crd_rules() if "nodes" in r["rule"])
    program = celpy.Environment().program(celpy.Environment().compile(rule["rule"]))

    def accepted(name: str, spec: dict[str, Any]) -> bool:
        return bool(program.evaluate({"self": json_to_cel({"metadata": {"name": name}, "spec": spec})}))

    long = "m" * (MULTI_NODE_NAME_MAX_LENGTH + 1)
    assert not accepted(long, two_nodes()) and "at most 40" in rule["message"]
    assert accepted(long[:-1], two_nodes()) and accepted(long, {"model": {"task": "generate"}})
    with pytest.raises(SpecError) as caught:
        build_children(batched_model(long, two_nodes()))
    assert caught.value.reason == "InvalidName" and "at most 40" in caught.value.message
    build_children(batched_model(long, {}))  # one pod per replica: the usual 63


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ({"task": "embed", "tensorParallelSize": 2}, "task generate"),
        ({"task": "generate", "engine": "carpool", "nodes": 2, "pipelineParallelSize": 2}, "vllm or auto"),
        ({"task": "generate", "engine": "carpool", "tensorParallelSize": 2}, "vllm or auto"),
        ({"task": "embed", "engine": "vllm"}, "generate only"),
        ({"task": "generate", "tensorParallelSize": 3, "attentionHeads": 64}, "attentionHeads"),
        ({"task": "generate", "tensorParallelSize": 3, "nodes": 2}, "must divide"),
        ({"task": "generate", "nodes": 2, "pipelineParallelSize": 2, "nodeRank": 1}, "nodeRank"),
        ({"task": "generate", "leaderAddress": "x"}, "leaderAddress"),
    ],
)
def test_the_crd_and_the_operator_refuse_what_vllm_refuses(model: dict[str, Any], words: str) -> None:
    failed = failed_rules({"model": model})
    assert failed, f"no CEL rule refused {model}"
    with pytest.raises(SpecError) as caught:
        build_children(batched_model("m", {"model": model, "resources": {"limits": {"cpu": "2"}}}))
    assert caught.value.reason == "InvalidSpec"
    assert words in caught.value.message


@pytest.mark.parametrize(
    "model",
    [
        llm(tensorParallelSize=8, attentionHeads=64),
        llm(tensorParallelSize=8, pipelineParallelSize=2, nodes=2),
        {"task": "generate", "tensorParallelSize": 2},  # engine auto: vLLM where installed
        {"task": "generate", "engine": "carpool"},
        {"task": "embed", "engine": "carpool"},
        {"task": "generate", "nodeRank": 0, "leaderPort": 29500},  # the schema's defaults, filled in
    ],
)
def test_consistent_parallel_specs_pass_the_crd_and_the_operator(model: dict[str, Any]) -> None:
    assert not failed_rules({"model": model})
    gpus = max(
        model.get("tensorParallelSize", 1) * model.get("pipelineParallelSize", 1) // model.get("nodes", 1), 1
    )
    build_children(batched_model("m", {"model": model, "resources": {"limits": {GPU: gpus}}}))


# --- status from the LeaderWorkerSet ----------------------------------------------------------------


def lws_status(wanted: int, replicas: int, ready: int) -> dict[str, Any]:
    """A LeaderWorkerSet as its controller reports it: counts of groups, no observedGeneration."""
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": wanted},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            "hpaPodSelector": "leaderworkerset.sigs.k8s.io/name=m,leaderworkerset.sigs.k8s.io/worker-index=0",
            "conditions": [{"type": "Available", "status": "True", "reason": "AllGroupsReady"}],
        },
    }


def test_ready_groups_make_the_model_ready() -> None:
    status = compute_status(
        generation=1, previous=None, now=NOW, deployment=lws_status(2, 2, 2), workload_kind="LeaderWorkerSet"
    )
    assert status.phase == Phase.READY
    ready = status.condition(ConditionType.READY)
    assert ready is not None and ready.reason == "ReplicasReady"


def test_a_group_still_loading_is_progressing() -> None:
    status = compute_status(
        generation=1, previous=None, now=NOW, deployment=lws_status(2, 2, 1), workload_kind="LeaderWorkerSet"
    )
    warmed = status.condition(ConditionType.WARMED_UP)
    assert warmed is not None and warmed.message == "1 of 2 replicas finished loading and warm-up"


def test_a_leader_worker_set_not_there_yet_is_named() -> None:
    status = compute_status(generation=1, previous=None, now=NOW, workload_kind="LeaderWorkerSet")
    progressing = status.condition(ConditionType.PROGRESSING)
    assert progressing is not None and progressing.message == "the LeaderWorkerSet is being created"
