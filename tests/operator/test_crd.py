"""The generated CRD: committed copy up to date, structural, valid, and accepting every example;
its CEL rules evaluated (with cel-python) on good and bad specs."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from celpy.adapter import json_to_cel

from carpool.operator.crd import build_crd, render_crd
from tests.operator.factories import EXAMPLES, KUBERNETES_VERSIONS, ROOT

CRD_FILE = ROOT / "crds" / "batchedmodel.yaml"


def schema() -> dict[str, Any]:
    version = build_crd()["spec"]["versions"][0]
    result: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return result


def test_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text() == render_crd(), (
        "crds/batchedmodel.yaml is stale: run `carpool crd > crds/...`"
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_passes_the_official_schema(version: str) -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), version, strict=True)


def nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from nodes(node[key], f"{path}[]")


def test_schema_is_structural() -> None:
    for path, node in nodes(schema()):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: CEL cost needs bounded lists"


def test_crd_has_the_subresources_columns_and_names() -> None:
    crd = build_crd()
    assert crd["spec"]["names"]["shortNames"] == ["bm"]
    assert crd["spec"]["names"]["categories"] == ["carpool"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert columns == ["Ready", "Replicas", "Task", "Endpoint", "Age"]
    spec = schema()["properties"]["spec"]["properties"]
    assert spec["model"]["properties"]["task"]["enum"] == ["embed", "classify", "generate", "rerank"]
    assert spec["autoscaling"]["properties"]["engine"]["enum"] == ["hpa", "keda"]
    assert spec["batching"]["properties"]["maxBatchSize"]["maximum"] == 4096


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused, as `kubectl apply` (strict field validation) does."""
    node = copy.deepcopy(node)
    for _, child in nodes(node):
        if "properties" in child and not child.get("x-kubernetes-preserve-unknown-fields"):
            child["additionalProperties"] = False
    return node


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_accepted_by_the_crd_schema(path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    # OpenAPI 3.0 bounds (boolean exclusiveMinimum) are draft-4 JSON Schema.
    jsonschema.Draft4Validator(strict(schema())).validate(body)
    assert not failed_rules(body["spec"])


def test_schema_refuses_typos_and_out_of_range_values() -> None:
    validator = jsonschema.Draft4Validator(strict(schema()))
    base = {"apiVersion": "carpool.dev/v1alpha1", "kind": "BatchedModel", "metadata": {"name": "m"}}
    assert not list(validator.iter_errors({**base, "spec": {}}))
    assert list(validator.iter_errors({**base, "spec": {"batching": {"maxBatchSizes": 8}}}))
    assert list(validator.iter_errors({**base, "spec": {"batching": {"maxBatchSize": 0}}}))
    assert list(validator.iter_errors({**base, "spec": {"model": {"task": "translate"}}}))
    assert list(validator.iter_errors({**base, "spec": {"autoscaling": {"targetQueueDepth": 0}}}))


def rules(node: dict[str, Any], value: Any) -> Iterator[tuple[str, Any]]:
    """(rule, the value `self` is bound to) for every CEL rule whose field is present in `value`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule["rule"], value
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name in value:
                yield from rules(child, value[name])


def failed_rules(spec: dict[str, Any]) -> list[str]:
    env = celpy.Environment()
    failed = []
    for rule, value in rules(schema()["properties"]["spec"], spec):
        program = env.program(env.compile(rule))
        if not bool(program.evaluate({"self": json_to_cel(value)})):
            failed.append(rule)
    return failed


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"batching": {"maxBatchSize": 16, "preferredBatchSizes": [8, 32]}}, "preferredBatchSizes"),
        ({"batching": {"preferredBatchSizes": [64]}}, "preferredBatchSizes"),
        ({"batching": {"priorityLevels": 2, "defaultPriority": 2}}, "defaultPriority"),
        ({"batching": {"maxQueueSize": 10, "maxItemsPerRequest": 11}}, "maxItemsPerRequest"),
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "maxReplicas"),
        ({"autoscaling": {"minReplicas": 0}}, "'keda'"),
        # The default query reads a metric only running pods export: zero needs a query of its own.
        ({"autoscaling": {"engine": "keda", "minReplicas": 0}}, "keda.query"),
        ({"model": {"task": "embed"}, "generation": {}}, "generate"),
        ({"generation": {}}, "generate"),
        ({"model": {"maxInputTokens": 10000}}, "maxInputTokens"),
        ({"model": {"quantization": "int4"}}, "quantization"),
        ({"model": {"task": "classify", "quantization": "int8"}}, "quantization"),
        ({"model": {"task": "generate", "instances": 2}}, "instances"),
        ({"model": {"task": "generate", "processes": 2}}, "processes"),
    ],
)
def test_cel_rules_refuse_cross_field_mistakes(spec: dict[str, Any], words: str) -> None:
    failed = failed_rules(spec)
    assert failed and any(words in rule for rule in failed), failed


def test_cel_rules_accept_consistent_specs() -> None:
    assert not failed_rules({})
    assert not failed_rules({"autoscaling": {"engine": "keda", "minReplicas": 0, "keda": {"query": "up"}}})
    # Behind an InferencePool the endpoint picker holds requests and its queue wakes the model.
    assert not failed_rules({"routing": "inferencePool", "autoscaling": {"minReplicas": 0}})
    assert not failed_rules({"model": {"task": "generate"}, "generation": {"maxRunningSequences": 8}})
    assert not failed_rules({"batching": {"maxBatchSize": 64, "preferredBatchSizes": [8, 64]}})
    assert not failed_rules({"model": {"task": "generate", "quantization": "int4"}})
    assert not failed_rules({"model": {"quantization": "auto"}})
    assert not failed_rules({"model": {"instances": 4}})
    assert not failed_rules({"model": {"task": "generate", "instances": 1}})
    assert not failed_rules({"model": {"processes": 4}})
