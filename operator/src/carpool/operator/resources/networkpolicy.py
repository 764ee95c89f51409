"""The NetworkPolicy of a BatchedModel's pods: who may reach the serving port, who may scrape.

Two ingress rules (three for a model split over several nodes), nothing else admitted (with a CNI that
enforces NetworkPolicies):
- the serving port (8000), and the gRPC port (`spec.server.grpcPort`, unless 0), from the sources
  `spec.networkPolicy` names: by default every pod of the
  BatchedModel's namespace, plus named namespaces and free-form NetworkPolicyPeers (an ingress
  controller, `ipBlock` CIDRs for a LoadBalancer);
- the metrics port (8000, or 9090 when TLS moves /metrics to its own port) from the monitoring
  namespaces the operator is configured with (`carpool operator --metrics-namespace`, set by the chart);
- with `spec.routing: inferencePool`, the metrics port from the model's endpoint picker (its pods,
  labelled `inferencepool: <name>-epp`, in the model's namespace), which scrapes every pod of its pool
  to choose one;
- for a LeaderWorkerSet, any port from the BatchedModel's own pods (the ranks of a group talk to each
  other on ports vLLM, NCCL or Ray pick).

A rule with no source is left out rather than written with an empty `from`, which Kubernetes reads as
"from anywhere". Egress is not restricted: where models are downloaded from varies (a hub, an object
store, a proxy). Kubelet probes come from the node and are not subject to the policy on the common
CNIs. Namespaces are matched by their `kubernetes.io/metadata.name` label, which Kubernetes sets on
every namespace since 1.22.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from carpool.operator import RUNTIME_PORT
from carpool.operator.resources.access import metrics_port
from carpool.operator.resources.inferencepool import endpoint_picker_pods
from carpool.operator.resources.labels import selector_labels, standard_labels
from carpool.operator.spec import BatchedModelSpec, Routing

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

DEFAULT_METRICS_NAMESPACES: tuple[str, ...] = ("monitoring",)
"""Where Prometheus runs unless the operator is told otherwise (kube-prometheus-stack's usual home)."""


def _namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: name}}}


def _port(*numbers: int) -> list[dict[str, Any]]:
    return [{"port": number, "protocol": "TCP"} for number in numbers if number]


def serving_sources(spec: BatchedModelSpec) -> list[dict[str, Any]]:
    """The NetworkPolicyPeers allowed to the serving port."""
    policy = spec.network_policy
    sources: list[dict[str, Any]] = []
    if policy.same_namespace:
        sources.append({"podSelector": {}})  # a bare podSelector: every pod of the policy's namespace
    sources += [_namespace(name) for name in dict.fromkeys(policy.from_namespaces)]
    sources += [dict(peer) for peer in policy.ingress_from]
    return sources


def network_policy(spec: BatchedModelSpec, name: str, metrics_namespaces: Sequence[str]) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    if sources := serving_sources(spec):
        rules.append({"from": sources, "ports": _port(RUNTIME_PORT, spec.server.grpc_port)})
    if spec.routing == Routing.INFERENCE_POOL:
        # The picker scrapes /metrics of every pod it may choose (its traffic goes to the serving port
        # from the gateway's proxies, which `spec.networkPolicy` names).
        picker = {"podSelector": {"matchLabels": endpoint_picker_pods(name)}}
        rules.append({"from": [picker], "ports": _port(metrics_port(spec))})
    if spec.model.multi_node():
        # A LeaderWorkerSet group's pods reach each other on any port: vLLM's ranks rendezvous at the
        # leader (torch.distributed or Ray) and exchange activations on ports they pick at start-up.
        rules.append({"from": [{"podSelector": {"matchLabels": selector_labels(name)}}]})
    scrapers = [_namespace(namespace) for namespace in dict.fromkeys(metrics_namespaces) if namespace]
    if scrapers:
        rules.append({"from": scrapers, "ports": _port(metrics_port(spec))})
    body: dict[str, Any] = {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"]}
    if rules:  # no rule at all: all ingress denied (the API server drops an empty list, so omit it)
        body["ingress"] = rules
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": body,
    }
