"""The pod around the runtime: rollout, HPA pacing, model cache, credentials, init fetch, pass-through."""

from __future__ import annotations

import json
from typing import Any

import pytest

from carpool.operator.resources import build_children
from carpool.operator.resources.probes import STARTUP_PERIOD_SECONDS
from carpool.operator.validation import SpecError
from tests.operator.factories import batched_model

CPU_ONLY = {"resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}}


def children_of(spec: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in build_children(batched_model("m", spec)).manifests}


def pod_of(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = children_of(spec)["Deployment"]["spec"]["template"]
    return pod


def rolling(spec: dict[str, Any] | None) -> dict[str, Any]:
    update: dict[str, Any] = children_of(spec)["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    return update


def test_gpu_pods_roll_without_a_surge_pod_and_cpu_pods_without_losing_capacity() -> None:
    assert rolling(None) == {"maxSurge": 0, "maxUnavailable": 1}  # the default asks for one GPU
    assert rolling(CPU_ONLY) == {"maxSurge": 1, "maxUnavailable": 0}
    assert rolling({"rollout": {"maxSurge": "25%"}}) == {"maxSurge": "25%", "maxUnavailable": 1}


def test_a_rollout_that_can_never_progress_is_refused() -> None:
    with pytest.raises(SpecError, match="maxSurge and rollout\\.maxUnavailable"):
        build_children(batched_model("m", {**CPU_ONLY, "rollout": {"maxSurge": 0}}))


@pytest.mark.parametrize(("startup", "period"), [(600, 600), (30, 30), (7200, 1800)])
def test_hpa_scale_up_adds_a_wave_of_pods_per_startup_budget(startup: int, period: int) -> None:
    behavior = children_of({"startupTimeoutSeconds": startup})["HorizontalPodAutoscaler"]["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0  # react to the first high reading
    assert {p["periodSeconds"] for p in behavior["scaleUp"]["policies"]} == {period}


def test_startup_probe_budget_equals_the_startup_timeout() -> None:
    container = pod_of({"startupTimeoutSeconds": 120})["spec"]["containers"][0]
    probe = container["startupProbe"]
    assert probe["httpGet"]["path"] == "/v2/health/ready"
    assert probe["periodSeconds"] == STARTUP_PERIOD_SECONDS
    assert probe["periodSeconds"] * probe["failureThreshold"] == 120
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_without_a_cache_the_pods_keep_an_emptydir_and_no_init_container() -> None:
    pod = pod_of({"modelCacheSizeLimit": "20Gi"})["spec"]
    assert "initContainers" not in pod
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache == {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}}


def test_a_shared_cache_is_one_pvc_filled_by_the_fetch_init_container() -> None:
    spec = {"model": {"source": "org/model", "cache": {"size": "50Gi", "storageClassName": "nfs"}}}
    children = children_of(spec)
    claim = children["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "m-model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "nfs",
    }
    pod = children["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "m-model-cache"}
    (fetch,) = pod["initContainers"]
    assert fetch["command"] == ["carpool", "fetch"]
    assert {"name": "CARPOOL_CONFIG", "value": "/etc/carpool/runtime.yaml"} in fetch["env"]
    assert fetch["image"] == pod["containers"][0]["image"]
    assert {"name": "model-cache", "mountPath": "/var/cache/carpool"} in fetch["volumeMounts"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    runtime_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert runtime_env["HF_HUB_OFFLINE"] == "1"  # fetched: the runtime never downloads in its budget


def test_a_per_pod_cache_is_an_ephemeral_volume_and_creates_no_pvc() -> None:
    children = children_of({"model": {"cache": {"size": "20Gi", "accessMode": "ReadWriteOnce"}}})
    assert "PersistentVolumeClaim" not in children
    pod = children["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    template = cache["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert template["accessModes"] == ["ReadWriteOnce"]
    assert template["resources"]["requests"]["storage"] == "20Gi"


def test_an_existing_claim_is_mounted_and_never_created() -> None:
    children = children_of({"model": {"cache": {"claimName": "models"}}})
    assert "PersistentVolumeClaim" not in children
    pod = children["Deployment"]["spec"]["template"]["spec"]
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "models"}


def test_the_hub_token_is_a_mounted_file_never_config_or_env() -> None:
    spec = {
        "model": {"source": "org/gated", "cache": {"claimName": "c"}, "credentials": {"secretName": "hub"}}
    }
    children = children_of(spec)
    pod = children["Deployment"]["spec"]["template"]["spec"]
    secret = next(v for v in pod["volumes"] if v["name"] == "hub-credentials")["secret"]
    assert secret["secretName"] == "hub" and secret["items"] == [{"key": "token", "path": "token"}]
    for container in [*pod["initContainers"], *pod["containers"]]:
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN_PATH"]["value"] == "/var/run/secrets/carpool/hub/token"
        assert not any("valueFrom" in e for e in container["env"])
        assert any(m["name"] == "hub-credentials" and m["readOnly"] for m in container["volumeMounts"])
    assert "hub" not in json.dumps(children["ConfigMap"]["data"])
    assert "credentials" not in children["ConfigMap"]["data"]["runtime.yaml"]


def test_pass_through_pod_fields_and_a_sized_shm() -> None:
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
    pod = pod_of(
        {
            "podLabels": {"team": "search"},
            "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/etc/prompts"}],
            "topologySpreadConstraints": [spread],
            "shmSize": "2Gi",
        }
    )
    assert pod["metadata"]["labels"]["team"] == "search"
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "m"
    spec = pod["spec"]
    assert spec["topologySpreadConstraints"] == [spread]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in spec["volumes"]
    assert {"name": "extra", "configMap": {"name": "prompts"}} in spec["volumes"]
    mounts = spec["containers"][0]["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts
    assert {"name": "extra", "mountPath": "/etc/prompts"} in mounts


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"podLabels": {"app.kubernetes.io/instance": "other"}}, "app.kubernetes.io/"),
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "volume name 'tmp'"),
        ({"model": {"cache": {"claimName": "a", "size": "1Gi"}}}, "either claimName"),
    ],
)
def test_pod_fields_that_would_break_the_pod_are_refused(spec: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        build_children(batched_model("m", spec))
