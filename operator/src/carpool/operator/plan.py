"""What the reconciler writes, in which order: a pure plan from the desired children and the live ones.

`plan_writes` takes the built children and a snapshot of what exists, and returns the steps (no I/O),
so every decision below is unit-tested without an API server:

- **Ownership.** A live object of a child's name that this BatchedModel does not control (no
  controller owner reference with its uid) is never applied over or deleted: applying with `force`
  would take it over, and garbage collection would later delete it with the BatchedModel. The plan
  reports a conflict naming the object instead; the reconciler turns it into `Ready=False`, reason
  `ResourceConflict`, and a Warning Event.
- **Re-created models take their children over.** A child whose controller is a BatchedModel of *this*
  name with another uid belongs to a predecessor that no longer exists (names are unique in a
  namespace, and the uid in hand is the one the name holds now): a model deleted with `--wait=false`
  and applied again at once (`helm upgrade`, Argo CD, a hurried user). The apply rewrites the owner
  reference (server-side apply merges `ownerReferences` by uid, and the predecessor's entry is this
  field manager's, so it goes), in the same reconcile, before the garbage collector removes the
  child; one the collector deleted meanwhile is re-created on its DELETE event.
- **Deletions first.** Children the spec no longer wants are deleted before anything is applied, so an
  autoscaler switch (hpa to keda, keda to hpa, autoscaling off) removes the old scaler before the new
  one exists and before the Deployment gets a replica count of its own: KEDA's admission webhook
  refuses a ScaledObject for a Deployment an HPA already scales, and two autoscalers (or an autoscaler
  and the operator) would fight over `spec.replicas`.
- **Applied only when changed** (`diff.changes`): a status write by the HPA or the Deployment
  controller sends nothing.
- **Replica hand-over.** While autoscaling is on, the Deployment manifest leaves `spec.replicas` out
  (the autoscaler owns it). With server-side apply, a field the operator's manager stops sending is
  *removed* (reset to 1) unless another manager owns it too, so before such an apply a second field
  manager (`REPLICAS_MANAGER`) applies just the current replica count, without force: it co-owns the
  value, the operator's apply then drops only its own claim, and the count stays what it was until the
  autoscaler writes (which takes the field over). A new Deployment is created with the autoscaler's
  minimum the same way. When the autoscaler already owns the field, the hand-over conflicts (409) and
  is skipped: nothing to hand over. One exception: the HPA controller never scales a Deployment that
  stands at 0 replicas (its condition says "ScalingDisabled") unless its `minReplicas` is 0 (scale to
  zero, the HPAScaleToZero feature gate), so a count of 0 (KEDA scaled to zero, or `replicas: 0` with
  autoscaling off) is never handed to an HPA with a minimum above 0: the hand-over raises it to the HPA's
  minimum, with `force`, taking the field from whoever held it. A LeaderWorkerSet (a model split over
  several nodes) is handed over the same way: its `spec.replicas` counts groups.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from carpool.operator import FIELD_MANAGER, KIND
from carpool.operator.diff import changes

SCALED_KINDS = frozenset({"Deployment", "LeaderWorkerSet"})
"""The workloads whose replica count an autoscaler may own (the LeaderWorkerSet's counts groups)."""

REPLICAS_MANAGER = "carpool-operator-replicas"
"""Field manager that holds a Deployment's replica count between the operator and the autoscaler."""


class Action(enum.StrEnum):
    DELETE = "delete"
    APPLY = "apply"
    HAND_OVER_REPLICAS = "hand-over-replicas"


@dataclass(frozen=True)
class Step:
    action: Action
    api_version: str
    kind: str
    name: str
    manifest: dict[str, Any] | None = None
    """The body to apply (APPLY, HAND_OVER_REPLICAS)."""
    reasons: tuple[str, ...] = ()
    """Why it is applied (changed paths), for the log."""
    force: bool = False
    """HAND_OVER_REPLICAS only: take the replica count over from its current owner."""


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    """One message per live object of a child's name that this BatchedModel does not own."""


Key = tuple[str, str]
"""(kind, name) of a child in the owner's namespace."""


def controlled_by(child: Mapping[str, Any], owner_uid: str | None) -> bool:
    """Whether `child` names the BatchedModel with `owner_uid` as its controller."""
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") != KIND or not ref.get("controller"):
            continue
        if owner_uid is None or ref.get("uid") == owner_uid:
            return True
    return False


def superseded(child: Mapping[str, Any], owner_name: str | None, owner_uid: str | None) -> str | None:
    """The uid of a predecessor of this BatchedModel (same name, other uid) that controls `child`."""
    if owner_name is None or owner_uid is None:
        return None
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller") and ref.get("name") == owner_name:
            uid = ref.get("uid")
            return str(uid) if uid != owner_uid else None
    return None


def conflict_message(kind: str, name: str, namespace: str, live: Mapping[str, Any]) -> str:
    owners = [
        f"{ref.get('kind')} {ref.get('name')}"
        for ref in (live.get("metadata") or {}).get("ownerReferences") or []
        if ref.get("controller")
    ]
    held = f"controlled by {owners[0]}" if owners else "not created by this BatchedModel"
    return (
        f"{kind} {namespace}/{name} already exists and is {held}; carpool does not take it over. "
        f"Rename or delete that {kind}, or rename this BatchedModel."
    )


def _replicas_body(manifest: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    meta = manifest["metadata"]
    return {
        "apiVersion": manifest["apiVersion"],
        "kind": manifest["kind"],
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
        "spec": {"replicas": replicas},
    }


def plan_writes(
    *,
    manifests: list[dict[str, Any]],
    absent: list[tuple[str, str, str]],
    live: Mapping[Key, Mapping[str, Any] | None],
    owner_uid: str | None,
    namespace: str,
    initial_replicas: int,
    owner_name: str | None = None,
    overridden: Mapping[Key, frozenset[str]] | None = None,
) -> Plan:
    """The writes that bring the children in line. `absent` lists (api_version, kind, name) of
    children the spec does not want; `live` maps (kind, name) to the live object or None.
    `owner_name`: the BatchedModel's name, whose predecessors' children are taken over.
    `overridden`: per child, paths admission rewrites on every apply of its current desired state
    (reported, not fought over)."""
    plan = Plan()

    def ours(found: Mapping[str, Any]) -> bool:
        return controlled_by(found, owner_uid) or superseded(found, owner_name, owner_uid) is not None

    for api_version, kind, name in absent:
        found = live.get((kind, name))
        if found is not None and ours(found):
            plan.steps.append(Step(Action.DELETE, api_version, kind, name))
        # Not ours (or gone): nothing to delete, and nothing to complain about either.
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        api_version = manifest["apiVersion"]
        current = live.get((kind, name))
        if current is not None and not ours(current):
            plan.conflicts.append(conflict_message(kind, name, namespace, current))
            continue
        reasons = changes(manifest, current, FIELD_MANAGER, (overridden or {}).get((kind, name), frozenset()))
        predecessor = superseded(current, owner_name, owner_uid) if current is not None else None
        if predecessor is not None:
            reasons = [f"taken over from a deleted {KIND} of this name (uid {predecessor})", *reasons]
        if not reasons:
            continue
        autoscaled = kind in SCALED_KINDS and "replicas" not in manifest.get("spec", {})
        if autoscaled and current is None:
            body = copy.deepcopy(manifest)
            body["spec"]["replicas"] = initial_replicas
            plan.steps.append(Step(Action.APPLY, api_version, kind, name, body, tuple(reasons)))
            hand_over = _replicas_body(manifest, initial_replicas)
            plan.steps.append(Step(Action.HAND_OVER_REPLICAS, api_version, kind, name, hand_over))
            continue
        if autoscaled and current is not None:
            replicas = (current.get("spec") or {}).get("replicas")
            count = int(replicas) if replicas is not None else initial_replicas
            to_hpa = any(m["kind"] == "HorizontalPodAutoscaler" for m in manifests)
            # The HPA controller would never scale it up from 0, unless its own minimum is 0.
            revive = to_hpa and count == 0 and initial_replicas > 0
            hand_over = _replicas_body(manifest, initial_replicas if revive else count)
            plan.steps.append(
                Step(Action.HAND_OVER_REPLICAS, api_version, kind, name, hand_over, force=revive)
            )
        plan.steps.append(Step(Action.APPLY, api_version, kind, name, manifest, tuple(reasons)))
    return plan
