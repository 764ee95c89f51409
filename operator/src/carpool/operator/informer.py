"""What the operator's watches last saw of its children and runtime pods: kopf's indexes, read as an
informer's store.

kopf already streams every child and runtime pod the operator owns (the label-selected watches in
`handlers.children`). Indexes on the same streams (`handlers.children`: one per child kind, keyed by
(apiVersion, kind, namespace, name), and the pods keyed by (namespace, instance label)) keep the latest
of each object; kopf updates an index before it calls the handlers of the same event, and calls no
handler before every index has finished its first listing (client-go's `WaitForCacheSync`). A reconcile
reads the children and pods from here instead of asking the API server for each (about ten GETs and a
pod LIST per reconcile, and every status change of a pod or child starts one), as controller-runtime's
cached client does.

An index can lag behind the server (an event still in flight) or miss an object (a kind the operator
does not watch, such as the cache PVC, or one deleted). So it only saves requests and never decides a
write on its own: an object missing here is read from the server, and when the children as indexed call
for any write (or show a conflict) the reconcile reads them all from the server again and plans on that
(`reconcile._apply`). A child indexed older than the server's copy is followed by its own watch event,
which reconciles again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from carpool.operator.resources.labels import INSTANCE_LABEL

POD_INDEX = "index_pods"
CHILD_INDEX_PREFIX = "index_"


def child_key(body: Mapping[str, Any]) -> tuple[str, str, str, str]:
    meta = body.get("metadata") or {}
    return (
        str(body.get("apiVersion")),
        str(body.get("kind")),
        str(meta.get("namespace")),
        str(meta.get("name")),
    )


def pod_key(body: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata") or {}
    instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    return (str(meta.get("namespace")), str(instance)) if instance else None


class Informer:
    """Read-only lookups in kopf's indexes (`indices`: the index name -> kopf's live index)."""

    def __init__(self, indices: Mapping[str, Any]) -> None:
        self._children = [
            index
            for name, index in indices.items()
            if name.startswith(CHILD_INDEX_PREFIX) and name != POD_INDEX
        ]
        self._pods = indices.get(POD_INDEX)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as last seen, or None when not seen (not the same as absent: read it then)."""
        key = (api_version, kind, namespace, name)
        for index in self._children:
            if key in index:
                return _latest(index[key])
        return None

    def pods_of(self, namespace: str, instance: str) -> list[dict[str, Any]] | None:
        """The model's runtime pods as last seen (None: no pod index, list them)."""
        if self._pods is None:
            return None
        key = (namespace, instance)
        return [dict(pod) for pod in self._pods[key]] if key in self._pods else []


def _latest(values: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    found = list(values)
    return dict(found[-1]) if found else None
