"""The PersistentVolumeClaim the operator creates for a shared model cache (`model.cache.size` with
`ReadWriteMany`). An existing claim (`claimName`) is the user's and never touched; a per-pod cache is a
generic ephemeral volume in the pod template, created and deleted by Kubernetes with each pod."""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import standard_labels
from carpool.operator.spec import BatchedModelSpec
from carpool.operator.spec_pods import CacheAccessMode


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def cache_claim(spec: BatchedModelSpec, name: str) -> dict[str, Any] | None:
    """The PVC to create, or None when the spec asks for none."""
    cache = spec.model.cache
    if cache is None or cache.claim_name or cache.size is None or cache.access_mode != CacheAccessMode.SHARED:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": [CacheAccessMode.SHARED.value],
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class_name:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache_claim_name(name), "labels": standard_labels(name)},
        "spec": claim_spec,
    }
