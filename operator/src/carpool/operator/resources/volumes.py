"""The pod's volumes and the runtime container's mounts.

The operator's own volumes: the rendered config (read-only), a writable /tmp (the root filesystem is
read-only), the model cache at /var/cache/carpool, a memory-backed /dev/shm when `shmSize` is set (16Gi
by default for a model split over several devices, `PARALLEL_SHM_SIZE`), and
the hub token Secret when `model.credentials` is set (mounted as a file, read through
`HF_TOKEN_PATH`; never an environment variable, which `kubectl describe` and crash dumps show), and the
API-key and TLS Secrets of `auth` and `tls` (`access`: runtime container only). Then the user's
pass-through `volumes` and `volumeMounts`.

The model cache is, by `model.cache`:
- absent: an emptyDir per pod (`modelCacheSizeLimit`), filled again by every new pod;
- `claimName`: that existing PVC, shared by all pods;
- `size` with `ReadWriteMany`: the PVC `<name>-model-cache` the operator creates (`resources.cache`),
  shared by all pods, so the model is downloaded once;
- `size` with `ReadWriteOnce`: a generic ephemeral volume per pod (a PVC created and deleted with the
  pod): survives container restarts, not pod replacement, and works on any storage class.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.resources import access
from carpool.operator.resources.labels import CONFIG_DIR, CONFIG_FILE, config_map_name
from carpool.operator.spec import BatchedModelSpec
from carpool.operator.spec_pods import CacheAccessMode

CACHE_DIR = "/var/cache/carpool"
CREDENTIALS_DIR = "/var/run/secrets/carpool/hub"
SHM_DIR = "/dev/shm"
RESERVED_VOLUMES = frozenset({"config", "tmp", "model-cache", "dshm", "hub-credentials"}) | access.VOLUMES

PARALLEL_SHM_SIZE = "16Gi"
"""/dev/shm of a model split over several devices when `shmSize` is unset: NCCL passes tensors between
the GPUs of a pod through shared memory (and vLLM's workers their inputs), and the container runtime's
64Mi makes NCCL fail at start-up. vLLM's own Kubernetes examples give 15Gi-20Gi. It is memory-backed:
it counts against the pod's memory limit, and only what is written uses memory."""


def shm_size(spec: BatchedModelSpec) -> str | None:
    """The size of the memory-backed /dev/shm, or None for the container runtime's default."""
    if spec.shm_size is not None:
        return str(spec.shm_size)
    return PARALLEL_SHM_SIZE if spec.model.parallel() else None


def _cache_volume(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    cache = spec.model.cache
    if cache is None:
        limit = {"sizeLimit": str(spec.model_cache_size_limit)} if spec.model_cache_size_limit else {}
        return {"name": "model-cache", "emptyDir": limit}
    claim = cache.shared_claim(name)
    if claim is not None:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}
    claim_spec: dict[str, Any] = {
        "accessModes": [CacheAccessMode.PER_POD.value],
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class_name:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "name": "model-cache",
        "ephemeral": {"volumeClaimTemplate": {"spec": claim_spec}},
    }


def pod_volumes(spec: BatchedModelSpec, name: str) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {
            "name": "config",
            "configMap": {
                "name": config_map_name(name),
                "items": [{"key": CONFIG_FILE, "path": CONFIG_FILE}],
            },
        },
        {"name": "tmp", "emptyDir": {}},
        _cache_volume(spec, name),
    ]
    if (shm := shm_size(spec)) is not None:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    credentials = spec.model.credentials
    if credentials is not None:
        volumes.append(
            {
                "name": "hub-credentials",
                "secret": {
                    "secretName": credentials.secret_name,
                    "items": [{"key": credentials.key, "path": "token"}],
                    "defaultMode": 0o440,
                },
            }
        )
    volumes += access.secret_volumes(spec)
    volumes += [dict(volume) for volume in spec.volumes]
    return volumes


def base_mounts(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """Mounts shared by the runtime and the fetch init container: config, /tmp, cache, credentials."""
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-cache", "mountPath": CACHE_DIR},
    ]
    if spec.model.credentials is not None:
        mounts.append({"name": "hub-credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True})
    return mounts


def runtime_mounts(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    mounts = base_mounts(spec)
    if shm_size(spec) is not None:
        mounts.append({"name": "dshm", "mountPath": SHM_DIR})
    mounts += access.secret_mounts(spec)
    mounts += [dict(mount) for mount in spec.volume_mounts]
    return mounts


def cache_env(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """Where libraries keep downloads, and where the hub token is (a file path, not the token)."""
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        # The root filesystem is read-only: libraries that write under $HOME (compiler caches) use /tmp.
        {"name": "HOME", "value": "/tmp"},
    ]
    if spec.model.credentials is not None:
        env.append({"name": "HF_TOKEN_PATH", "value": f"{CREDENTIALS_DIR}/token"})
    return env
