"""Generated chart files are current, and values.yaml documents every value (cert-manager's `+docs`)."""

from __future__ import annotations

from typing import Any

import yaml
from charts import generate
from charts.values import Values


def test_generated_files_are_up_to_date() -> None:
    assert generate.stale() == [], "run `python -m charts.generate` and commit the result"


def test_the_chart_ships_the_operator_crd_byte_for_byte() -> None:
    assert generate.CRD_SOURCE.exists(), "crds/batchedmodel.yaml (issue 3, `carpool crd`) is missing"
    assert generate.CRD_COPY.read_bytes() == generate.CRD_SOURCE.read_bytes()


def _leaves(node: Any, prefix: str = "") -> list[str]:
    # Free-form values (Kubernetes objects, the endpoint picker's flags and config) are one value each.
    free_form = ("resources", "Context", "affinity", "endpointPicker.flags", "endpointPicker.config")
    if isinstance(node, dict) and node and not prefix.endswith(free_form):
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}.{key}".lstrip("."))]
    return [prefix]


def test_every_value_has_a_description_and_a_docs_marker() -> None:
    text = generate.VALUES_YAML.read_text()
    values = yaml.safe_load(text)
    leaves = _leaves(values)
    assert text.count("# +docs:property") == len(leaves)
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.strip() == "# +docs:property":
            above = lines[number - 1].strip()
            assert above.startswith("# ") and len(above) > 4, f"value after line {number} has no description"


def test_values_yaml_is_the_models_defaults() -> None:
    assert yaml.safe_load(generate.VALUES_YAML.read_text()) == Values().model_dump(by_alias=True)


def test_the_schema_rejects_unknown_keys_in_every_object_of_ours() -> None:
    def walk(node: dict[str, Any], where: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} accepts unknown keys"
            for key, child in node["properties"].items():
                walk(child, f"{where}.{key}")

    walk(generate.values_schema(), "values")
