"""The Service in front of the runtime pods: the HTTP port (API and /metrics), and the gRPC port (KServe v2
over gRPC and grpc.health.v1) unless `spec.server.grpcPort` is 0. For a model split over several nodes
(a LeaderWorkerSet) it selects the groups' leaders only: the workers serve nothing."""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.access import serving_port_name
from carpool.operator.resources.labels import LEADER, ROLE_LABEL, selector_labels, standard_labels
from carpool.operator.spec import BatchedModelSpec


def serving_pod_labels(spec: BatchedModelSpec, name: str) -> dict[str, str]:
    """The labels of the pods that serve the API: every runtime pod, or a group's leader."""
    labels = selector_labels(name)
    if spec.model.multi_node():
        labels[ROLE_LABEL] = LEADER
    return labels


def service(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": standard_labels(name)}
    if spec.service.annotations:
        metadata["annotations"] = dict(spec.service.annotations)
    port = serving_port_name(spec)
    ports: list[dict[str, Any]] = [
        {"name": port, "port": spec.service.port, "targetPort": port, "protocol": "TCP"}
    ]
    if spec.server.grpc_port:
        grpc = spec.server.GRPC_PORT_NAME
        # appProtocol tells meshes and gateways (Istio, Gateway API's GRPCRoute backends) it is gRPC.
        ports.append(
            {
                "name": grpc,
                "port": spec.server.grpc_port,
                "targetPort": grpc,
                "protocol": "TCP",
                "appProtocol": "grpc",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": spec.service.type.value,
            "selector": serving_pod_labels(spec, name),
            "ports": ports,
        },
    }
