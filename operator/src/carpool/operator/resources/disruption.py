"""The PodDisruptionBudget: node drains evict runtime pods a few at a time.

`maxUnavailable`, not `minAvailable`: a single-replica or scaled-to-zero model must not block drains.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.labels import selector_labels, standard_labels
from carpool.operator.spec import BatchedModelSpec


def disruption_budget(spec: BatchedModelSpec, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": standard_labels(name)},
        "spec": {
            "maxUnavailable": spec.disruption_budget.max_unavailable,
            "selector": {"matchLabels": selector_labels(name)},
        },
    }
