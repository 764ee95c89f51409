"""The BatchedModel status, typed: phase, replica counts, endpoint and Kubernetes-style conditions.

`status.compute` fills it from the children; `crd` turns it into the status schema; `reconcile` writes
it through the status subresource.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Phase(enum.StrEnum):
    """One-word summary of the model's state."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    IDLE = "Idle"
    FAILED = "Failed"


class ConditionType(enum.StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    WARMED_UP = "WarmedUp"
    DEGRADED = "Degraded"
    AUTOSCALING = "Autoscaling"


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class _Status(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="ignore",
        use_attribute_docstrings=True,
    )


class Condition(_Status):
    """An observation of one aspect of the model's state (Kubernetes API conventions)."""

    type: ConditionType
    """Ready, Progressing, WarmedUp, Degraded or Autoscaling."""

    status: ConditionStatus
    """True, False or Unknown."""

    reason: str = Field(min_length=1, max_length=1024)
    """Machine-readable CamelCase reason for the last transition."""

    message: str = Field(default="", max_length=32768)
    """What a person should know, and do."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation the condition was computed from."""

    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""


class BatchedModelStatus(_Status):
    """What the operator observed."""

    phase: Phase = Phase.PENDING
    """Pending, Progressing, Ready, Degraded, Idle (scaled to zero) or Failed (the spec cannot work)."""

    replicas: int = Field(default=0, ge=0)
    """Runtime pods that exist (the scale subresource reads it)."""

    ready_replicas: int = Field(default=0, ge=0)
    """Pods that loaded the model, finished warm-up and take traffic."""

    updated_replicas: int = Field(default=0, ge=0)
    """Pods running the current spec."""

    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation this status describes."""

    endpoint: str | None = None
    """In-cluster URL of the model service."""

    selector: str | None = None
    """Label selector of the runtime pods (for the scale subresource)."""

    config_hash: str | None = None
    """Hash of the rendered runtime config the pods should run."""

    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready, Progressing, WarmedUp, Degraded, Autoscaling."""

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)
