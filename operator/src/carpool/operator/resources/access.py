"""How `spec.auth` and `spec.tls` reach the runtime pods: Secret volumes, the runtime's `server` settings
that point at them, and probes and ports that follow the scheme. Pure; the deployment and config
builders call it.

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


def secure_pod(spec: BatchedModelSpec, pod: dict[str, Any]) -> None:
    """Add the Secret volumes and mounts, and switch ports and probes to TLS, in a runtime pod spec."""
    container = pod["containers"][0]
    if spec.auth is not None:
        secret = spec.auth.api_keys_secret
        pod["volumes"].append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": secret.name,
                    "items": [{"key": secret.key, "path": secret.key}],
                    "defaultMode": SECRET_MODE,
                },
            }
        )
        container["volumeMounts"].append({"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True})
    if spec.tls is None:
        return
    pod["volumes"].append(
        {"name": "tls", "secret": {"secretName": spec.tls.secret_name, "defaultMode": SECRET_MODE}}
    )
    container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container["ports"] = [
        {"name": "https", "containerPort": RUNTIME_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            container[probe]["httpGet"].update({"port": "https", "scheme": "HTTPS"})
