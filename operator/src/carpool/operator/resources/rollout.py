"""The Deployment's rollout strategy, sized for GPU pools.

A surge pod needs a free GPU. On a full GPU pool (the usual state: GPUs are expensive) `maxSurge: 1,
maxUnavailable: 0` leaves the surge pod Pending until the progress deadline and the rollout never
moves. So pods that request GPUs default to `maxSurge: 0, maxUnavailable: 1` (an old pod goes, its GPU
goes to the new one; one replica's capacity is missing meanwhile); CPU-only pods keep `1/0` (capacity
never drops). `spec.rollout` overrides either value.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.spec import BatchedModelSpec


def default_rollout(gpus: int) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) when the spec sets none."""
    return (0, 1) if gpus else (1, 0)


def strategy(spec: BatchedModelSpec) -> dict[str, Any]:
    surge, unavailable = default_rollout(spec.resources.gpus())
    rollout = spec.rollout
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {
            "maxSurge": rollout.max_surge if rollout.max_surge is not None else surge,
            "maxUnavailable": rollout.max_unavailable if rollout.max_unavailable is not None else unavailable,
        },
    }
