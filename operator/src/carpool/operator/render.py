"""`carpool render`: the children of a BatchedModel file, exactly as the operator would apply them.

The BatchedModel usually does not exist yet, so it has no uid; the owner references then carry a
placeholder uid (and a comment says so). Pipe the output into `kubectl apply --dry-run=server -f -`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from carpool.operator import API_VERSION, KIND
from carpool.operator.resources import build_children
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES
from carpool.operator.spec import DEFAULT_IMAGE
from carpool.operator.yamlio import dump_all

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


class RenderError(ValueError):
    pass


def load_models(text: str) -> list[dict[str, Any]]:
    """The BatchedModel documents in a YAML stream (other kinds are skipped)."""
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc]
    except yaml.YAMLError as exc:
        raise RenderError(f"not valid YAML: {exc}") from exc
    models = []
    for doc in documents:
        if not isinstance(doc, dict):
            raise RenderError("every YAML document must be a mapping")
        if doc.get("kind") == KIND:
            if doc.get("apiVersion") != API_VERSION:
                raise RenderError(f"{KIND} apiVersion must be {API_VERSION}, got {doc.get('apiVersion')}")
            models.append(doc)
    if not models:
        raise RenderError(f"no {KIND} in the input")
    return models


def render_children(
    model: dict[str, Any],
    namespace: str | None = None,
    metrics_namespaces: Sequence[str] = DEFAULT_METRICS_NAMESPACES,
    runtime_image: str = DEFAULT_IMAGE,
) -> list[dict[str, Any]]:
    meta = dict(model.get("metadata") or {})
    if not meta.get("name"):
        raise RenderError(f"{KIND} has no metadata.name")
    meta["namespace"] = namespace or meta.get("namespace") or "default"
    meta.setdefault("uid", PLACEHOLDER_UID)
    return build_children({**model, "metadata": meta}, metrics_namespaces, runtime_image).manifests


def render(
    text: str,
    namespace: str | None = None,
    metrics_namespaces: Sequence[str] = DEFAULT_METRICS_NAMESPACES,
    runtime_image: str = DEFAULT_IMAGE,
) -> str:
    """YAML documents of all children of all BatchedModels in `text`; raises SpecError or RenderError."""
    out: list[str] = []
    for model in load_models(text):
        manifests = render_children(model, namespace, metrics_namespaces, runtime_image)
        if (model.get("metadata") or {}).get("uid") is None:
            out.append(f"# {KIND} {model['metadata']['name']}: owner uid is a placeholder until it exists\n")
        out.append(dump_all(manifests))
    return "---\n".join(out)
