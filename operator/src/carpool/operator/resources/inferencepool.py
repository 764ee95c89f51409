"""The InferencePool of a model routed through the Gateway API Inference Extension (`spec.routing:
inferencePool`), named after the model.

An InferencePool (inference.networking.k8s.io/v1) is a set of model-server pods behind one endpoint
picker (EPP): a conformant gateway (kgateway, Istio, GKE, NGINX Gateway Fabric...) routing an HTTPRoute to
the pool asks the picker, over Envoy's ext_proc protocol, which pod serves each request, and the picker
answers from what it scrapes of every pod's /metrics (queue depth, KV-cache use, loaded LoRA adapters:
the `vllm:*` names the runtime exports) and what it remembers of the prompts it sent where (prefix-cache
affinity). Called by `build_children`; pure.

- `selector`: the pods that serve the API, as the Service's (`service.serving_pod_labels`): every runtime
  pod, or only each LeaderWorkerSet group's leader for a model split over several nodes (its workers
  serve nothing). An InferencePool selector is `matchLabels` only, which these are.
- `targetPorts`: the runtime's port 8000, where it serves the API and, without TLS, /metrics. The pool
  names the container port, not the Service's (the gateway sends to `podIP:port` directly); under
  `spec.tls` the picker scrapes the plain-HTTP metrics port instead (its `--model-server-metrics-port`,
  set by the chart's `endpointPicker`).
- `endpointPickerRef`: the Service `<name>-epp`, port 9002 (the picker's ext_proc port), as the chart's
  `endpointPicker` and the upstream `inferencepool` chart name it; `FailClose`, the API's default,
  spelt out so that the applied object equals the stored one: with the picker down the gateway refuses
  requests rather than spreading them blind.
"""

from __future__ import annotations

from typing import Any

from carpool.operator import RUNTIME_PORT
from carpool.operator.resources.labels import standard_labels
from carpool.operator.resources.service import serving_pod_labels
from carpool.operator.spec import BatchedModelSpec

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
ENDPOINT_PICKER_PORT = 9002
"""The picker's ext_proc gRPC port (its `--grpc-port` default)."""
FAILURE_MODE = "FailClose"
PICKER_POD_LABEL = "inferencepool"
"""The label of the picker's pods (value: its Service's name), as the upstream chart sets it: the
NetworkPolicy admits them to the metrics port."""


def endpoint_picker_name(name: str) -> str:
    """The Service of the model's endpoint picker (`<pool>-epp`, as the upstream chart names it)."""
    return f"{name}-epp"


def endpoint_picker_pods(name: str) -> dict[str, str]:
    """The labels of the model's endpoint picker pods (the chart's `endpointPicker` sets them)."""
    return {PICKER_POD_LABEL: endpoint_picker_name(name)}


def inference_pool(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "selector": {"matchLabels": serving_pod_labels(spec, name)},
            "targetPorts": [{"number": RUNTIME_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": endpoint_picker_name(name),
                "port": {"number": ENDPOINT_PICKER_PORT},
                "failureMode": FAILURE_MODE,
            },
        },
    }


MISSING_MESSAGE = (
    f"cannot create the {API_VERSION} InferencePool: is the Gateway API Inference Extension's CRD "
    f"({CRD_NAME}) installed? spec.routing: inferencePool routes through one; install the CRD "
    "(config/crd/bases in sigs.k8s.io/gateway-api-inference-extension), or set spec.routing: service. "
    "The Service serves the model meanwhile"
)
