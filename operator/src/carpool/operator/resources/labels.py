"""Names and labels of a BatchedModel's children (the pod labels are part of the runtime contract)."""

from __future__ import annotations

from typing import Final

from carpool.operator import FIELD_MANAGER

APP_NAME = "carpool-runtime"
CONFIG_HASH_ANNOTATION = "carpool.dev/config-hash"
CONFIG_FILE = "runtime.yaml"
CONFIG_DIR = "/etc/carpool"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "carpool.dev/role"
"""A pod's role in a LeaderWorkerSet group: `leader` (serves the API; the Service selects it) or `worker`."""
LEADER: Final = "leader"
WORKER: Final = "worker"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""Set by the LeaderWorkerSet controller on each pod of a group: 0 on the leader."""


def selector_labels(name: str) -> dict[str, str]:
    """The immutable Deployment selector: the runtime pods of one BatchedModel."""
    return {"app.kubernetes.io/name": APP_NAME, INSTANCE_LABEL: name}


def standard_labels(name: str) -> dict[str, str]:
    """The labels every child carries."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        "app.kubernetes.io/part-of": "carpool",
        "app.kubernetes.io/component": "model-server",
    }


def selector_string(name: str) -> str:
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def leader_worker_set_name(name: str) -> str:
    """The LeaderWorkerSet of a multi-node model. Not the model's own name: the LWS controller creates a
    headless Service named after its LeaderWorkerSet (the groups' DNS subdomain), which would otherwise
    be the BatchedModel's Service."""
    return f"{name}-lws"


def config_map_name(name: str) -> str:
    return f"{name}-runtime"


def endpoint(name: str, namespace: str, port: int, tls: bool = False) -> str:
    return f"{'https' if tls else 'http'}://{name}.{namespace}.svc:{port}"
