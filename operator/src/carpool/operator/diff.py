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

What admission did to the operator's own apply is not drift. A mutating webhook (a service mesh
injecting a sidecar, a policy engine pinning an image to its digest) changes the object inside the
operator's request; no other field manager owns what it adds (the API server does not record admission's
changes under a manager of their own):
- an entry of a keyed list that the operator does not send and that no *other* manager owns (`others`,
  from `managedFields`) came from admission: neither drift nor pruned. One another manager owns (added
  with `kubectl edit`) is drift, and `foreign_items` removes it;
- an image the operator sets as `repo:tag` and finds as `repo:tag@sha256:...` or `repo@sha256:...` is the
  same image pinned (`same_image`);
- any other value admission rewrites is one the operator cannot keep: the reconciler reports it and,
  for that desired state, stops applying over it (`plan.plan_writes`'s `overridden`).
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


def managed_by_others(live: Mapping[str, Any] | None, manager: str) -> dict[str, Any] | None:
    """The fields managers other than `manager` own in `live` (their `managedFields` merged: `f:`/`k:`
    keys); None when `live` tells nothing of its managers (no `managedFields`: then every entry the
    operator does not send counts as someone else's)."""
    entries = ((live or {}).get("metadata") or {}).get("managedFields")
    if not entries:
        return None
    owned: dict[str, Any] = {}
    for entry in entries:
        if entry.get("manager") != manager and isinstance(entry.get("fieldsV1"), Mapping):
            _merge(owned, entry["fieldsV1"])
    return owned


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping):
            _merge(into.setdefault(key, {}), value)
        else:
            into.setdefault(key, value)


def _owned_field(owned: Mapping[str, Any] | None, key: str) -> Mapping[str, Any] | None:
    """The subtree of `key`; None where nothing is known (no `managedFields` given), else a mapping."""
    if owned is None:
        return None
    found = owned.get(f"f:{key}")
    return found if isinstance(found, Mapping) else {}


def _owned_entry(owned: Mapping[str, Any] | None, field: str, key: Any) -> Mapping[str, Any] | None:
    if owned is None:
        return None
    found = owned.get("k:" + json.dumps({field: key}, separators=(",", ":")))
    return found if isinstance(found, Mapping) else {}


def _others_own_entry(others: Mapping[str, Any] | None, field: str, key: Any) -> bool:
    return bool(_owned_entry(others, field, key))


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def same_image(desired: Any, live: Any) -> bool:
    """`live` is `desired` pinned to a digest (`repo:tag@sha256:...`, or `repo@sha256:...`)."""
    if not isinstance(desired, str) or not isinstance(live, str) or not _DIGEST.search(live):
        return False
    pinned = _DIGEST.sub("", live)
    repository = desired.rsplit(":", 1)[0] if ":" in desired.rsplit("/", 1)[-1] else desired
    return pinned in (desired, repository)


def drift(
    desired: Any, live: Any, path: str = "", others: Mapping[str, Any] | None = None, key: str = ""
) -> list[str]:
    """Paths where `live` does not hold what `desired` says (desired must be a subset of live).
    `others`: the fields other managers own in `live` (`managed_by_others`); entries of keyed lists the
    operator does not send and no other manager owns came from admission and are not drift."""
    if live is None and any(desired == empty and type(desired) is type(empty) for empty in _EMPTY):
        return []  # dropped by the server (omitempty): absent means the same
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        found: list[str] = []
        for name, value in desired.items():
            found += drift(value, live.get(name), f"{path}.{name}", _owned_field(others, name), name)
        return found
    field = LIST_KEYS.get(key)
    if field and others is not None and isinstance(desired, list) and isinstance(live, list):
        return _keyed_drift(desired, live, path, others, field)
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
    if key == "image" and same_image(desired, live):
        return []
    if _is_quantity_path(path):
        want, have = canonical_quantity(desired), canonical_quantity(live)
        if want is not None and want == have:
            return []
    # int-or-string fields (ports, maxSurge) may come back as the other type: `1` and "1".
    if not isinstance(desired, bool) and not isinstance(live, bool) and str(desired) == str(live):
        return [] if desired is not None and live is not None else [path]
    return [path]


def _keyed_drift(
    desired: list[Any], live: list[Any], path: str, others: Mapping[str, Any], field: str
) -> list[str]:
    """A keyed list: each desired entry, in the order the operator sends them; extra live entries only
    where admission put them (no other manager owns them)."""
    entries = [item for item in live if isinstance(item, Mapping)]
    keys = [item.get(field) for item in entries]
    wanted = [item.get(field) for item in desired if isinstance(item, Mapping)]
    added = [k for k in keys if k not in wanted and _others_own_entry(others, field, k)]
    if added or [k for k in keys if k in wanted] != wanted:
        return [path]
    found: list[str] = []
    for want in desired:
        if not isinstance(want, Mapping):
            continue
        index = keys.index(want.get(field))
        found += drift(want, entries[index], f"{path}[{index}]", _owned_entry(others, field, want.get(field)))
    return found


def _pointer(parts: list[str | int]) -> str:
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def foreign_items(
    desired: Any, live: Any, at: list[str | int] | None = None, others: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """JSON Patch operations that remove entries of keyed lists (`LIST_KEYS`) present in `live` but not
    in `desired`: what another field manager added (an env var, a container), which server-side apply
    keeps because the operator does not own it. Given `others` (the fields other managers own), an entry
    no other manager owns came from admission during the operator's apply (a sidecar a mesh injects) and
    stays. Each removal is guarded by a
    `test` of the entry's key, so a list changed meanwhile fails the patch instead of losing the wrong
    entry. Metadata is left alone (labels and annotations of others are theirs to keep)."""
    at = at or []
    ops: list[dict[str, Any]] = []
    if isinstance(desired, Mapping) and isinstance(live, Mapping):
        for key, value in desired.items():
            if at == [] and key == "metadata":
                continue
            child = live.get(key)
            field = LIST_KEYS.get(key)
            sub = _owned_field(others, key)
            if field and isinstance(value, list) and isinstance(child, list):
                ops += _foreign_entries(value, child, field, [*at, key], sub)
            else:
                ops += foreign_items(value, child, [*at, key], sub)
    return ops


def _foreign_entries(
    desired: list[Any], live: list[Any], field: str, at: list[str | int], others: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    wanted = {item.get(field): item for item in desired if isinstance(item, Mapping)}
    ops: list[dict[str, Any]] = []
    removals: list[dict[str, Any]] = []
    for index, item in enumerate(live):
        if not isinstance(item, Mapping):
            continue
        key = item.get(field)
        if key in wanted:
            ops += foreign_items(wanted[key], item, [*at, index], _owned_entry(others, field, key))
        elif others is None or _others_own_entry(others, field, key):
            removals.append({"index": index, "key": key})
    for removal in reversed(removals):  # from the end, so earlier indexes stay valid
        path = _pointer([*at, removal["index"]])
        ops += [
            {"op": "test", "path": f"{path}/{field}", "value": removal["key"]},
            {"op": "remove", "path": path},
        ]
    return ops


def changes(
    desired: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    manager: str | None = None,
    overridden: frozenset[str] = frozenset(),
) -> list[str]:
    """Why `desired` must be applied over `live`; empty when nothing needs applying.

    `desired` carries its hash (`stamp`). A live object without the hash, or with another one, was
    applied from a different desired state (or by an older operator): apply. Otherwise apply only what
    drifted, leaving out what admission did to `manager`'s own apply (see the module's docstring) and
    the `overridden` paths, which admission rewrites on every apply of this desired state.
    """
    if live is None:
        return ["absent"]
    want = applied_hash(desired) or desired_hash(desired)
    if applied_hash(live) != want:
        return ["desired state changed"]
    others = managed_by_others(live, manager) if manager else None
    return [path for path in drift(desired, live, others=others) if path not in overridden]
