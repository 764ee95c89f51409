"""Spec sections about the pods around the runtime: rollout, model cache, hub credentials.

Kept apart from `spec` (which holds the resource's top level and the runtime's own sections) so that
each group of pod settings, and the builders that read it (`resources.volumes`, `resources.fetch`,
`resources.cache`), can grow without one large module. `spec` imports these models; the CRD is still
generated from `BatchedModelSpec` alone.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

CAMEL = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=False,
    validate_by_alias=True,
    serialize_by_alias=True,
    extra="forbid",
    use_attribute_docstrings=True,
)

Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]
"""A Kubernetes quantity (`2`, `500m`, `8Gi`) or, where the field says so, a percentage (`25%`)."""


def rules(*pairs: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in pairs]}


class RolloutSpec(BaseModel):
    """How a spec change replaces the pods (the Deployment's RollingUpdate strategy)."""

    model_config = CAMEL

    max_surge: Quantity | None = None
    """Pods created above the desired count during a rollout (a number or a percentage). Default: 0
    when the pods request GPUs (a full GPU pool has no room for an extra pod, which would stay Pending
    until the progress deadline), else 1."""

    max_unavailable: Quantity | None = None
    """Pods that may be missing during a rollout (a number or a percentage). Default: 1 when the pods
    request GPUs (an old pod frees its GPU for its replacement), else 0 (a new pod is warm before an
    old one goes)."""


class CacheAccessMode(enum.StrEnum):
    """How the operator-created model cache is shared between pods."""

    SHARED = "ReadWriteMany"
    PER_POD = "ReadWriteOnce"


class ModelCacheSpec(BaseModel):
    """Where the model's files are kept between pod starts (mounted at /var/cache/carpool)."""

    model_config = ConfigDict(
        **CAMEL,
        json_schema_extra=rules(
            (
                "!(has(self.claimName) && has(self.size))",
                "model.cache: set either claimName (an existing PVC) or size (a PVC the operator creates)",
            ),
            (
                "!has(self.storageClassName) || has(self.size)",
                "model.cache.storageClassName needs model.cache.size",
            ),
        ),
    )

    claim_name: str | None = Field(default=None, min_length=1, max_length=253)
    """An existing PersistentVolumeClaim to use as the cache (ReadWriteMany to share it between pods
    on several nodes). The operator never changes or deletes it."""

    size: Quantity | None = None
    """Create a cache of this size (`50Gi`). With `accessMode: ReadWriteMany` one PVC named
    `<name>-model-cache` is shared by all pods (the model is downloaded once); with `ReadWriteOnce`
    each pod gets its own volume (a generic ephemeral volume, deleted with the pod)."""

    storage_class_name: str | None = Field(default=None, min_length=1)
    """StorageClass of the created cache. Default: the cluster's default class."""

    access_mode: CacheAccessMode = CacheAccessMode.SHARED
    """`ReadWriteMany` (shared; needs a storage class that supports it, e.g. NFS, CephFS, EFS,
    Filestore) or `ReadWriteOnce` (one volume per pod)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.claim_name and self.size is not None:
            raise ValueError(
                "model.cache: set either claimName (an existing PVC) or size (a PVC the operator creates)"
            )
        if self.storage_class_name and self.size is None:
            raise ValueError("model.cache.storageClassName needs model.cache.size")
        return self

    def shared_claim(self, name: str) -> str | None:
        """The PVC all pods mount, or None when each pod has its own volume (or an emptyDir)."""
        if self.claim_name:
            return self.claim_name
        if self.size is not None and self.access_mode == CacheAccessMode.SHARED:
            return f"{name}-model-cache"
        return None


class CredentialsSpec(BaseModel):
    """A Secret holding the model hub token. It is mounted as a file into the fetch init container and
    the runtime (`HF_TOKEN_PATH`), never put in the ConfigMap, an environment variable or a log."""

    model_config = CAMEL

    secret_name: str = Field(min_length=1, max_length=253)
    """Name of the Secret (in the BatchedModel's namespace)."""

    key: str = Field(default="token", min_length=1, max_length=253)
    """Key of the token in the Secret."""


RESERVED_LABEL_PREFIX = "app.kubernetes.io/"

RESERVED_ENV = (
    "CARPOOL_CONFIG",
    "CARPOOL_MODEL__NODE_RANK",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_TOKEN_PATH",
    "HOME",
    "XDG_CACHE_HOME",
)
"""Environment variables the operator sets on the runtime container (`resources.deployment`,
`resources.lws`, `resources.volumes.cache_env`). A user entry of the same name would reach the API
server twice, which server-side apply refuses ("duplicate entries for key"), so `env` may not name them."""

NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 63
"""A BatchedModel's name is its Service's name (a DNS-1035 label: lower-case letters, digits and '-',
starting with a letter) and the value of its children's `app.kubernetes.io/instance` label (at most 63
characters). A custom resource's own name may be any DNS subdomain (`llama-3.1-8b`), which would be
accepted and then break at the Service, so the CRD and the operator both refuse it up front."""

MULTI_NODE_NAME_MAX_LENGTH = 40
"""The longest name of a BatchedModel split over several nodes. Its LeaderWorkerSet is `<name>-lws` (the
LWS controller names a headless Service after it, which must not take the BatchedModel's own Service
name), each group's leader StatefulSet `<name>-lws-<group>` and its workers' pods `<name>-lws-<group>-<n>`:
a StatefulSet's name plus the 11 characters of its pods' `controller-revision-hash` label must stay
within a label value's 63, with group numbers up to 999."""
"""Pod labels under this prefix are the operator's (selector and contract labels)."""
