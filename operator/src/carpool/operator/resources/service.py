"""The Service in front of the runtime pods (API and /metrics on one port)."""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.access import serving_port_name
from carpool.operator.resources.labels import selector_labels, standard_labels
from carpool.operator.spec import BatchedModelSpec


def service(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": standard_labels(name)}
    if spec.service.annotations:
        metadata["annotations"] = dict(spec.service.annotations)
    port = serving_port_name(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": spec.service.type.value,
            "selector": selector_labels(name),
            "ports": [{"name": port, "port": spec.service.port, "targetPort": port, "protocol": "TCP"}],
        },
    }
