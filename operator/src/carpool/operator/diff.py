"""Does a child need applying? Decided from the desired state, not by reading the live object back.

Two questions, two answers:
- *Did the desired object change?* Every child carries `carpool.dev/desired-hash`, a hash of the
  full manifest the operator last applied (`stamp` sets it). A different hash means the spec asks for
  something else, including *less* than before: a removed toleration, annotation or limit changes the
  hash, and the server-side apply of the full desired object then removes the fields this field manager
  owned and no longer sends. A subset comparison against the live object cannot see a removal.
- *Did someone else change a field the operator sets (drift)?* Every field of the desired object must
  be in the live one with the same value; fields the API server defaults (probe schemes,
  `terminationMessagePath`) or other controllers own (the autoscaler's `spec.replicas`, any `status`)
  are not the operator's business. Quantities compare in canonical form (`0.5` is `500m`, `1Gi` is
  `1073741824`), as the API server rewrites them, so a server-side normalisation is never drift.

`changes` answers both; the reconciler applies only when it returns something, which is what keeps
an HPA's status write (an event on the Deployment and the HPA) from turning into an apply.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

HASH_ANNOTATION = "carpool.dev/desired-hash"

_SUFFIXES: dict[str, Decimal] = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$")

_QUANTITY_PARENTS = ("requests", "limits", "capacity", "hard")
"""Maps whose values are quantities (resource requests and limits, a PVC's storage request)."""
_QUANTITY_KEYS = ("sizeLimit",)
_TARGET_QUANTITIES = ("value", "averageValue")
"""Quantities of an HPA metric's `target` (the server writes an averageValue of 1000 back as `1k`)."""

_EMPTY: tuple[Any, ...] = ("", [], {})
"""Values the API server drops (Go's `omitempty` on strings, lists and maps: an env var's `value: ""`)."""

LIST_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
"""Lists the API server merges by key under server-side apply (`x-kubernetes-list-type: map`): an entry
someone else added stays through the operator's apply, so `foreign_items` removes it."""


def canonical_quantity(value: Any) -> Decimal | None:
    """The number a Kubernetes quantity stands for, or None when `value` is not a quantity."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    try:
        amount = Decimal(number)
        if exponent:
            return amount * Decimal(10) ** int(exponent[1:])
        return amount * _SUFFIXES[suffix or ""]
    except (InvalidOperation, ValueError):
        return None


def desired_hash(manifest: Mapping[str, Any]) -> str:
    """Hash of a desired manifest, without its own hash annotation (stable across key order)."""
    meta = dict(manifest.get("metadata") or {})
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != HASH_ANNOTATION}
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    text = json.dumps({**manifest, "metadata": meta}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def stamp(manifest: dict[str, Any]) -> dict[str, Any]:
    """Put the manifest's desired hash on it (in place; returned for chaining)."""
    digest = desired_hash(manifest)
    meta = manifest.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), HASH_ANNOTATION: digest}
    return manifest


def applied_hash(live: Mapping[str, Any] | None) -> str | None:
    if not live:
        return None
    value = ((live.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
    return str(value) if value is not None else None


def _is_quantity_path(path: str) -> bool:
    parts = path.rsplit(".", 2)
    if parts[-1] in _QUANTITY_KEYS or (len(parts) >= 2 and parts[-2] in _QUANTITY_PARENTS):
        return True
    return len(parts) >= 2 and parts[-2] == "target" and parts[-1] in _TARGET_QUANTITIES


def drift(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths where `live` does not hold what `desired` says (desired must be a subset of live)."""
    if live is None and any(desired == empty and type(desired) is type(empty) for empty in _EMPTY):
        return []  # dropped by the server (omitempty): absent means the same
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        found: list[str] = []
        for key, value in desired.items():
            found += drift(value, live.get(key), f"{path}.{key}")
        return found
    if isinstance(desired, list):
        # The operator owns the lists it sets (containers, env, volumes): same length, item by item.
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        found = []
        for index, (want, have) in enumerate(zip(desired, live, strict=True)):
            found += drift(want, have, f"{path}[{index}]")
        return found
    if desired == live and type(desired) is type(live):
        return []
    if _is_quantity_path(path):
        want, have = canonical_quantity(desired), canonical_quantity(live)
        if want is not None and want == have:
            return []
    # int-or-string fields (ports, maxSurge) may come back as the other type: `1` and "1".
    if not isinstance(desired, bool) and not isinstance(live, bool) and str(desired) == str(live):
        return [] if desired is not None and live is not None else [path]
    return [path]


def _pointer(parts: list[str | int]) -> str:
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def foreign_items(desired: Any, live: Any, at: list[str | int] | None = None) -> list[dict[str, Any]]:
    """JSON Patch operations that remove entries of keyed lists (`LIST_KEYS`) present in `live` but not
    in `desired`: what another field manager added (an env var, a container), which server-side apply
    keeps because the operator does not own it. Each removal is guarded by a `test` of the entry's key,
    so a list changed meanwhile fails the patch instead of losing the wrong entry. Metadata is left
    alone (labels and annotations of others are theirs to keep)."""
    at = at or []
    ops: list[dict[str, Any]] = []
    if isinstance(desired, Mapping) and isinstance(live, Mapping):
        for key, value in desired.items():
            if at == [] and key == "metadata":
                continue
            child = live.get(key)
            field = LIST_KEYS.get(key)
            if field and isinstance(value, list) and isinstance(child, list):
                ops += _foreign_entries(value, child, field, [*at, key])
            else:
                ops += foreign_items(value, child, [*at, key])
    return ops


def _foreign_entries(
    desired: list[Any], live: list[Any], field: str, at: list[str | int]
) -> list[dict[str, Any]]:
    wanted = {item.get(field): item for item in desired if isinstance(item, Mapping)}
    ops: list[dict[str, Any]] = []
    removals: list[dict[str, Any]] = []
    for index, item in enumerate(live):
        if not isinstance(item, Mapping):
            continue
        key = item.get(field)
        if key in wanted:
            ops += foreign_items(wanted[key], item, [*at, index])
        else:
            removals.append({"index": index, "key": key})
    for removal in reversed(removals):  # from the end, so earlier indexes stay valid
        path = _pointer([*at, removal["index"]])
        ops += [
            {"op": "test", "path": f"{path}/{field}", "value": removal["key"]},
            {"op": "remove", "path": path},
        ]
    return ops


def changes(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> list[str]:
    """Why `desired` must be applied over `live`; empty when nothing needs applying.

    `desired` carries its hash (`stamp`). A live object without the hash, or with another one, was
    applied from a different desired state (or by an older operator): apply. Otherwise apply only what
    drifted.
    """
    if live is None:
        return ["absent"]
    want = applied_hash(desired) or desired_hash(desired)
    if applied_hash(live) != want:
        return ["desired state changed"]
    return drift(desired, live)
