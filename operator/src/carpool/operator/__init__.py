"""The carpool operator: a BatchedModel becomes a dynamically batched, autoscaled model service.

Layers, outermost first: `handlers/` (thin kopf functions) call `reconcile` (build, compare, apply,
report), which uses the pure `resources/` builders and `status/` computation and talks to the cluster
only through `kube`. `spec` is the single source of truth for the resource's shape; `crd` derives the
CustomResourceDefinition from it. Importing this package never imports torch or the runtime's serving
code: the operator image installs only `carpool.runtime.config` from the runtime.
"""

from __future__ import annotations

GROUP = "carpool.dev"
VERSION = "v1alpha1"
KIND = "BatchedModel"
PLURAL = "batchedmodels"
SINGULAR = "batchedmodel"
SHORT_NAMES = ("bm",)
CATEGORIES = ("carpool",)
API_VERSION = f"{GROUP}/{VERSION}"

FIELD_MANAGER = "carpool-operator"
"""The field manager of every write, so server-side apply tracks what the operator owns."""

RUNTIME_PORT = 8000
"""The runtime's HTTP port: API, health and /metrics (the contract in ARCHITECTURE.md)."""
