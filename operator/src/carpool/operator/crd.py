"""Generates the BatchedModel CustomResourceDefinition from the pydantic spec and status models.

`carpool crd` prints it; `crds/batchedmodel.yaml` is its committed output and a test fails when the two
differ. pydantic emits JSON Schema; a CRD needs a *structural* OpenAPI v3 schema, so this module
inlines `$ref`s, turns `X | None` into `nullable` (and a union of scalar types into a value the API server
keeps as given), rewrites draft-2020 `exclusiveMinimum` into the
OpenAPI 3.0 form, drops what the API server forbids or ignores (`title`, `additionalProperties: false`:
unknown fields are pruned, and `kubectl` warns about them), and bounds every list so that CEL rules
have a finite cost.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from carpool.operator import CATEGORIES, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from carpool.operator.spec import BatchedModelSpec
from carpool.operator.spec_pods import MULTI_NODE_NAME_MAX_LENGTH, NAME_MAX_LENGTH, NAME_PATTERN
from carpool.operator.status.model import BatchedModelStatus
from carpool.operator.yamlio import dump

MAX_ITEMS = 256
"""Bound of every list without its own; keeps CEL rules over lists within the API server's cost budget."""

_DROP = {"title", "$defs"}
_SCALARS = {"string", "integer", "number", "boolean"}


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model, as a CRD's `openAPIV3Schema` wants it."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    options = node.get("anyOf")
    if options is not None:
        others = [option for option in options if option.get("type") != "null"]
        if len(others) > 1 and all(option.get("type") in _SCALARS for option in others):
            # A value of several scalar types (vLLM's engine arguments: string, number or boolean):
            # a structural schema has no union, so the API server keeps the value as given and the
            # operator's own validation (the runtime's config model) refuses what is not a scalar.
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            return _convert({**rest, "x-kubernetes-preserve-unknown-fields": True}, defs)
        if len(others) == 1:
            merged = {**others[0], **{k: v for k, v in node.items() if k != "anyOf"}}
            if len(others) < len(options):
                merged["nullable"] = True
            return _convert(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "additionalProperties" and value is False):
            continue
        if key == "default" and value is None:
            continue
        if key == "properties":
            out[key] = {name: _convert(child, defs) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        else:
            out[key] = value
    if out.get("type") == "array":
        out.setdefault("maxItems", MAX_ITEMS)
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    return out


def printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Task", "type": "string", "jsonPath": ".spec.model.task"},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.source", "priority": 1},
    ]


def name_rule() -> dict[str, str]:
    """The BatchedModel's own name must suit its children (see `spec_pods.NAME_PATTERN`)."""
    return {
        "rule": (
            f"self.metadata.name.matches('{NAME_PATTERN}') && size(self.metadata.name) <= {NAME_MAX_LENGTH}"
        ),
        "message": (
            f"metadata.name must be a DNS-1035 label of at most {NAME_MAX_LENGTH} characters (lower-case "
            "letters, digits and '-', starting with a letter, e.g. llama-3-1-8b): it names the Service and "
            "labels every child"
        ),
    }


def multi_node_name_rule() -> dict[str, str]:
    """A model split over several nodes has a shorter name (see `spec_pods.MULTI_NODE_NAME_MAX_LENGTH`)."""
    return {
        "rule": (
            "!has(self.spec) || !has(self.spec.model) || !has(self.spec.model.nodes) || "
            f"self.spec.model.nodes == 1 || size(self.metadata.name) <= {MULTI_NODE_NAME_MAX_LENGTH}"
        ),
        "message": (
            f"metadata.name of a model with model.nodes above 1 must be at most {MULTI_NODE_NAME_MAX_LENGTH} "
            "characters: it names the LeaderWorkerSet, its StatefulSets and their pods"
        ),
    }


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    spec = openapi_schema(BatchedModelSpec)
    status = openapi_schema(BatchedModelStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "carpool", "app.kubernetes.io/part-of": "carpool"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": spec.get("description", ""),
                            "x-kubernetes-validations": [name_rule(), multi_node_name_rule()],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = "# Generated by `carpool crd` from carpool.operator.spec; do not edit by hand.\n"


def render_crd() -> str:
    """The CRD as YAML, exactly as committed in crds/batchedmodel.yaml."""
    return HEADER + dump(build_crd())
