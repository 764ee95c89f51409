"""Turns a BatchedModel body into a validated spec, or a `SpecError` that says what to change.

Two kinds of problem end here: what the CRD schema would have refused (possible when the CRD is old or
absent, as in tests against an emulator) and what the schema lets through but cannot work (an unknown
model source scheme, GPUs with the CPU-only image, CUDA without a GPU). The reconciler turns a
`SpecError` into a condition, an Event and `kopf.PermanentError`: retrying cannot fix a spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from carpool.operator.spec import CPU_IMAGE_SUFFIX, GPU_RESOURCE, BatchedModelSpec
from carpool.operator.spec_pods import MULTI_NODE_NAME_MAX_LENGTH, NAME_MAX_LENGTH, NAME_PATTERN

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_KNOWN_PREFIXES = ("pkg:", "hf:")


class SpecError(ValueError):
    """A spec that cannot work. `reason` is a CamelCase condition reason; the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def check_name(name: str) -> None:
    """The name must work as the Service's name and as a label value (the CRD's CEL rule says the same;
    this catches objects created before that rule, or under an older CRD)."""
    if len(name) > NAME_MAX_LENGTH or not re.match(NAME_PATTERN, name):
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r} cannot name the Service: it must be a DNS-1035 label of at most "
            f"{NAME_MAX_LENGTH} characters (lower-case letters, digits and '-', starting with a letter; "
            f"e.g. {_suggest(name)!r}). Nothing was created; delete it and create it under that name.",
        )


def check_multi_node_name(name: str) -> None:
    """A model split over several nodes names a LeaderWorkerSet, StatefulSets and pods after itself."""
    if len(name) > MULTI_NODE_NAME_MAX_LENGTH:
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r} is {len(name)} characters; with model.nodes above 1 it may have at most "
            f"{MULTI_NODE_NAME_MAX_LENGTH} (it names the LeaderWorkerSet {name}-lws, its StatefulSets and "
            "their pods). Nothing was created; delete it and create it under a shorter name.",
        )


def _suggest(name: str) -> str:
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned or not cleaned[0].isalpha():
        cleaned = "m-" + cleaned
    return cleaned[:NAME_MAX_LENGTH].rstrip("-")


def parse_spec(body: Mapping[str, Any]) -> BatchedModelSpec:
    """Validate the body's spec and check that it can work."""
    try:
        spec = BatchedModelSpec.model_validate(body.get("spec") or {})
    except ValidationError as exc:
        raise SpecError("InvalidSpec", "spec is invalid: " + _explain(exc)) from None
    check_spec(spec)
    return spec


def _explain(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "spec"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def check_spec(spec: BatchedModelSpec) -> None:
    """Refuse specs that pass the schema but cannot run."""
    source = spec.model.source
    match = _SCHEME.match(source)
    if match and not source.startswith(_KNOWN_PREFIXES):
        raise SpecError(
            "UnsupportedModelSource",
            f"model.source {source!r} uses the scheme {match.group(1)!r}, which the runtime cannot load. "
            "Use pkg:<package> (a model shipped in the image), hf:<org/name> or <org/name> (Hugging Face "
            "Hub), or a folder path mounted into the pod.",
        )
    gpus = spec.resources.gpus()
    image = spec.effective_image()
    if gpus and image.endswith(CPU_IMAGE_SUFFIX):
        raise SpecError(
            "NoImageForGPU",
            f"resources ask for {gpus} {GPU_RESOURCE} but image {image!r} is the CPU-only build, which "
            "cannot use a GPU. Drop `image` to get the CUDA build, or remove the GPU from resources.",
        )
    _check_pod(spec)
    _check_parallelism(spec, gpus)
    device = spec.model.device
    if not gpus and device.startswith("cuda"):
        raise SpecError(
            "NoGPUForDevice",
            f"model.device is {device!r} but resources request no {GPU_RESOURCE}, so the pod would have "
            "no GPU. Add `limits: {nvidia.com/gpu: 1}` to resources, or set model.device to auto or cpu.",
        )


def _check_parallelism(spec: BatchedModelSpec, gpus: int) -> None:
    """With GPUs, each pod must hold exactly its share of a replica's ranks: vLLM starts one rank per
    device and waits for all of them, so a pod with fewer GPUs never starts and one with more idles."""
    model = spec.model
    if not gpus or not model.parallel():
        return
    wanted = model.devices_per_node()
    if wanted != gpus:
        per = f" over {model.nodes} nodes" if model.multi_node() else ""
        raise SpecError(
            "ParallelismMismatch",
            f"model.tensorParallelSize {model.tensor_parallel_size} x pipelineParallelSize "
            f"{model.pipeline_parallel_size}{per} needs {wanted} {GPU_RESOURCE} per pod, but resources ask "
            f"for {gpus}. Set resources.limits {GPU_RESOURCE}: {wanted}, or change the parallel sizes.",
        )


def _check_pod(spec: BatchedModelSpec) -> None:
    from carpool.operator.resources.rollout import strategy  # builders import this module
    from carpool.operator.resources.volumes import RESERVED_VOLUMES

    update = strategy(spec)["rollingUpdate"]
    if str(update["maxSurge"]) in ("0", "0%") and str(update["maxUnavailable"]) in ("0", "0%"):
        raise SpecError(
            "InvalidRollout",
            "rollout.maxSurge and rollout.maxUnavailable are both 0 (counting the defaults: 0/1 with "
            "GPUs, 1/0 without), so a rollout could never replace a pod. Allow one of them.",
        )
    for volume in spec.volumes:
        name = volume.get("name")
        if name in RESERVED_VOLUMES:
            raise SpecError(
                "InvalidSpec",
                f"volumes: volume name {name!r} is the operator's ({', '.join(sorted(RESERVED_VOLUMES))}); "
                "rename it",
            )
