"""The CRD's descriptions say what the code does: documented numeric defaults equal the code's."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from carpool.operator.crd import build_crd
from carpool.operator.resources.autoscaling import MAX_POLICY_PERIOD_SECONDS, MIN_POLICY_PERIOD_SECONDS
from carpool.operator.resources.rollout import default_rollout
from carpool.runtime.config import DEFAULT_CONTEXT_CAP, KV_TOKENS_PER_SEQUENCE

ROOT = Path(__file__).resolve().parents[2]


def properties(node: dict[str, Any], path: str = "spec") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from properties(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from properties(node["items"], f"{path}[]")


def spec_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    return schema


def description(path: str) -> str:
    found = dict(properties(spec_schema()))[path]
    return str(found.get("description", ""))


def test_generation_defaults_are_documented_as_the_engine_applies_them() -> None:
    assert f"at most {DEFAULT_CONTEXT_CAP}" in description("spec.generation.maxModelLen")
    assert f"maxRunningSequences x {KV_TOKENS_PER_SEQUENCE}" in description(
        "spec.generation.kvCacheTokens"
    ) or f"max_running_sequences x {KV_TOKENS_PER_SEQUENCE}" in description("spec.generation.kvCacheTokens")
    assert "less than this share" in description("spec.generation.kvAdmitWatermark")
    # The engine uses the same constants, not literals of its own.
    source = (ROOT / "runtime/src/carpool/runtime/models/generation.py").read_text()
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == "carpool.runtime.config"
        for alias in node.names
    }
    assert {"DEFAULT_CONTEXT_CAP", "KV_TOKENS_PER_SEQUENCE"} <= imported


def test_operator_defaults_are_documented_as_the_builders_apply_them() -> None:
    surge_gpu, unavailable_gpu = default_rollout(gpus=1)
    surge_cpu, unavailable_cpu = default_rollout(gpus=0)
    surge_text = description("spec.rollout.maxSurge")
    unavailable_text = description("spec.rollout.maxUnavailable")
    assert (
        f"Default: {surge_gpu} when the pods request GPUs" in surge_text and f"else {surge_cpu}" in surge_text
    )
    assert f"Default: {unavailable_gpu} when the pods request GPUs" in unavailable_text
    assert f"else {unavailable_cpu}" in unavailable_text
    behavior = description("spec.autoscaling.behavior")
    assert f"({MIN_POLICY_PERIOD_SECONDS} s to {MAX_POLICY_PERIOD_SECONDS} s)" in behavior
    startup = description("spec.startupTimeoutSeconds")
    assert "/v2/health/ready" in startup and "failureThreshold x periodSeconds" in startup
