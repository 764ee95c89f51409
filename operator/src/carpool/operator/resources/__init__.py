"""Pure builders: a BatchedModel body in, its children's manifests out. No I/O.

`build_children` is what the reconciler applies and what `carpool render` prints, so the two cannot
drift. Every child is adopted with `kopf.adopt()`: owner reference (so deleting the BatchedModel deletes
them), namespace, and the owner's labels, on top of the standard labels the builders set; then
stamped with the hash of the desired object (`diff.stamp`), which decides later whether it changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from carpool.operator.diff import stamp
from carpool.operator.resources.autoscaling import horizontal_pod_autoscaler, scaled_object
from carpool.operator.resources.cache import cache_claim, cache_claim_name
from carpool.operator.resources.config import config_hash, config_map, render_runtime_config, runtime_config
from carpool.operator.resources.deployment import deployment, initial_replicas
from carpool.operator.resources.disruption import disruption_budget
from carpool.operator.resources.labels import (
    LWS_API_VERSION,
    LWS_KIND,
    endpoint,
    leader_worker_set_name,
    selector_string,
)
from carpool.operator.resources.lws import leader_worker_set
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES, network_policy
from carpool.operator.resources.service import service
from carpool.operator.spec import DEFAULT_IMAGE, AutoscalingEngine, BatchedModelSpec
from carpool.operator.validation import check_multi_node_name, check_name, parse_spec

__all__ = ["ChildRef", "Children", "build_children", "initial_replicas"]


@dataclass(frozen=True)
class ChildRef:
    """Identifies a child by API version, kind and name (in the owner's namespace)."""

    api_version: str
    kind: str
    name: str

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> ChildRef:
        return cls(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])


@dataclass
class Children:
    """What a BatchedModel should own: manifests to apply, and children to remove if present."""

    spec: BatchedModelSpec
    manifests: list[dict[str, Any]]
    absent: list[ChildRef] = field(default_factory=list)
    config_hash: str = ""
    endpoint: str = ""
    selector: str = ""

    def find(self, kind: str) -> dict[str, Any] | None:
        return next((m for m in self.manifests if m["kind"] == kind), None)

    def workload(self) -> dict[str, Any]:
        """The Deployment, or the LeaderWorkerSet of a model split over several nodes."""
        found = self.find(LWS_KIND) or self.find("Deployment")
        assert found is not None
        return found


def build_children(
    body: Mapping[str, Any],
    metrics_namespaces: Sequence[str] = DEFAULT_METRICS_NAMESPACES,
    runtime_image: str = DEFAULT_IMAGE,
) -> Children:
    """The children of a BatchedModel body; raises `SpecError` for a spec that cannot work.
    `metrics_namespaces`: where Prometheus scrapes from (the operator's `--metrics-namespace`);
    `runtime_image`: the image pods run unless the spec names one (`--runtime-image`), from which the
    `-cpu` and `-vllm` tags are derived."""
    meta = body.get("metadata", {})
    name: str = meta["name"]
    check_name(name)  # before anything is built, so that no child is ever written under a bad name
    spec = parse_spec(body)
    if spec.image is None:  # every builder below reads the one image the operator chose
        spec = spec.model_copy(update={"image": spec.effective_image(runtime_image)})
    if spec.model.multi_node():
        check_multi_node_name(name)
    namespace: str = meta.get("namespace") or "default"

    config = runtime_config(spec)
    text = render_runtime_config(config)
    digest = config_hash(text)

    workloads = [
        ChildRef("apps/v1", "Deployment", name),
        ChildRef(LWS_API_VERSION, LWS_KIND, leader_worker_set_name(name)),
    ]
    if spec.model.multi_node():
        pods = leader_worker_set(spec, name, digest, config.drain_timeout())
        absent: list[ChildRef] = [workloads[0]]  # the Deployment, after nodes went from 1 to more
    else:
        pods = deployment(spec, name, digest, config.drain_timeout())
        absent = [workloads[1]]
    manifests = [config_map(name, text), pods, service(spec, name)]
    hpa = ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", name)
    keda = ChildRef("keda.sh/v1alpha1", "ScaledObject", name)
    if not spec.autoscaling.enabled:
        absent += [hpa, keda]
    elif spec.autoscaling.engine == AutoscalingEngine.HPA:
        manifests.append(horizontal_pod_autoscaler(spec, name))
        absent.append(keda)
    else:
        manifests.append(scaled_object(spec, name, namespace, config.served_name()))
        absent.append(hpa)
    claim = cache_claim(spec, name)
    if claim is not None:
        manifests.insert(1, claim)  # before the Deployment, so new pods find their volume
    else:
        absent.append(ChildRef("v1", "PersistentVolumeClaim", cache_claim_name(name)))
    if spec.disruption_budget.enabled:
        manifests.append(disruption_budget(spec, name))
    else:
        absent.append(ChildRef("policy/v1", "PodDisruptionBudget", name))
    if spec.network_policy.enabled:
        # Before the Deployment: a new pod is never admitted to traffic its policy would refuse.
        manifests.insert(manifests.index(pods), network_policy(spec, name, metrics_namespaces))
    else:
        absent.append(ChildRef("networking.k8s.io/v1", "NetworkPolicy", name))

    kopf.adopt(manifests, owner=kopf.Body(cast(kopf.RawBody, dict(body))))
    for manifest in manifests:
        stamp(manifest)  # the desired-state hash that decides whether a live child needs applying
    return Children(
        spec=spec,
        manifests=manifests,
        absent=absent,
        config_hash=digest,
        endpoint=endpoint(name, namespace, spec.service.port, tls=spec.tls is not None),
        selector=selector_string(name),
    )
