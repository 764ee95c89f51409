"""How `spec.auth` and `spec.tls` reach the runtime pods: Secret volumes, the runtime's `server` settings
that point at them, and probes and ports that follow the scheme. Pure; the volumes, probes, deployment,
Service, config and NetworkPolicy builders call it.

- API keys: the Secret is mounted as a folder (never with `subPath`, which would freeze the file) at
  `/etc/carpool/auth`, so the kubelet's updates (a symlink swap) reach the running runtime, which
  re-reads the file; the ConfigMap carries only the file's path, never a key.
- TLS: the `kubernetes.io/tls` Secret is mounted at `/etc/carpool/tls` (`tls.crt`, `tls.key`), the
  serving port is named `https` (what meshes and Services read the protocol from) and the probes use
  `scheme: HTTPS` (the kubelet does not verify the certificate). /metrics moves to a plain-HTTP port
  of its own (`metrics`, 9090), so Prometheus scrapes every model the same way, TLS or not, and the
  NetworkPolicy opens that port alone to the monitoring namespace.
"""

from __future__ import annotations

from typing import Any

from carpool.operator import RUNTIME_PORT
from carpool.operator.spec import BatchedModelSpec

AUTH_DIR = "/etc/carpool/auth"
TLS_DIR = "/etc/carpool/tls"
METRICS_PORT = 9090
"""The runtime's /metrics port when the serving port speaks TLS."""

SECRET_MODE = 0o440
"""Owner and group (the pod's fsGroup) read; nobody else."""


def serving_port_name(spec: BatchedModelSpec) -> str:
    return "https" if spec.tls is not None else "http"


def metrics_port(spec: BatchedModelSpec) -> int:
    """The container port Prometheus scrapes /metrics on."""
    return METRICS_PORT if spec.tls is not None else RUNTIME_PORT


def metrics_port_name(spec: BatchedModelSpec) -> str:
    return "metrics" if spec.tls is not None else "http"


def server_settings(spec: BatchedModelSpec) -> dict[str, Any]:
    """The runtime's `server` settings for auth and TLS (file paths only)."""
    settings: dict[str, Any] = {}
    if spec.auth is not None:
        settings["api_keys_file"] = f"{AUTH_DIR}/{spec.auth.api_keys_secret.key}"
    if spec.tls is not None:
        settings["tls"] = {"cert_file": f"{TLS_DIR}/tls.crt", "key_file": f"{TLS_DIR}/tls.key"}
        settings["metrics_port"] = METRICS_PORT
    return settings


AUTH_VOLUME = "api-keys"
TLS_VOLUME = "tls"
VOLUMES = frozenset({AUTH_VOLUME, TLS_VOLUME})
"""Volume names this module adds to the pod (reserved: a user volume may not take them)."""


def secret_volumes(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """The pod's Secret volumes for the API keys and the TLS certificate (`resources.volumes` adds
    them beside the operator's other volumes)."""
    volumes: list[dict[str, Any]] = []
    if spec.auth is not None:
        secret = spec.auth.api_keys_secret
        volumes.append(
            {
                "name": AUTH_VOLUME,
                "secret": {
                    "secretName": secret.name,
                    "items": [{"key": secret.key, "path": secret.key}],
                    "defaultMode": SECRET_MODE,
                },
            }
        )
    if spec.tls is not None:
        volumes.append(
            {"name": TLS_VOLUME, "secret": {"secretName": spec.tls.secret_name, "defaultMode": SECRET_MODE}}
        )
    return volumes


def secret_mounts(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """The runtime container's mounts of `secret_volumes` (folders: no `subPath`, so rotations reach it).
    The fetch init container gets neither: it serves nothing."""
    mounts: list[dict[str, Any]] = []
    if spec.auth is not None:
        mounts.append({"name": AUTH_VOLUME, "mountPath": AUTH_DIR, "readOnly": True})
    if spec.tls is not None:
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    return mounts


def container_ports(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """The runtime container's ports: the serving port (`https` under TLS), and /metrics on its own
    plain-HTTP port when the serving port speaks TLS."""
    ports = [{"name": serving_port_name(spec), "containerPort": RUNTIME_PORT, "protocol": "TCP"}]
    if spec.tls is not None:
        ports.append({"name": metrics_port_name(spec), "containerPort": METRICS_PORT, "protocol": "TCP"})
    return ports


def probe_target(spec: BatchedModelSpec) -> dict[str, str]:
    """The `httpGet` port and scheme of every probe: the serving port, in HTTPS under TLS (the kubelet
    does not verify the certificate)."""
    target = {"port": serving_port_name(spec)}
    if spec.tls is not None:
        target["scheme"] = "HTTPS"
    return target
