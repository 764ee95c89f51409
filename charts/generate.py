"""Writes the chart's generated files: `values.yaml` and `values.schema.json` from `charts.values`, and
`files/rbac-rules.yaml` from the operator's own declaration of its API permissions (`carpool.operator.rbac`),
and `crds/batchedmodel.yaml` as a copy of the repository's `crds/batchedmodel.yaml`.

Run `python -m charts.generate` after changing the values model; `--check` (what the chart tests do)
fails when a file on disk differs from what would be written. `values.yaml` follows cert-manager's
convention: each value carries its description and a `# +docs:property` marker, each top-level group a
`# +docs:section` marker.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from carpool.operator import rbac
from charts.values import Values

CHART = Path(__file__).resolve().parent / "carpool"
VALUES_YAML = CHART / "values.yaml"
VALUES_SCHEMA = CHART / "values.schema.json"
RBAC_RULES = CHART / "files" / "rbac-rules.yaml"
CRD_SOURCE = CHART.parents[1] / "crds" / "batchedmodel.yaml"
"""The CRD the operator generates (`carpool crd`); the chart ships a byte-for-byte copy in crds/."""
CRD_COPY = CHART / "crds" / "batchedmodel.yaml"

_HEADER = """\
# Values of the carpool chart. GENERATED from charts/values.py by `python -m charts.generate`:
# edit the model there, not this file (a test fails when the two differ).
# values.schema.json, generated from the same model, rejects unknown keys and wrong types.
"""


def _comment(text: str, indent: str) -> list[str]:
    lines = [" ".join(paragraph.split()) for paragraph in text.strip().split("\n\n")]
    out: list[str] = []
    for i, paragraph in enumerate(lines):
        if i:
            out.append(f"{indent}#")
        out.extend(_wrap(paragraph, indent))
    return out


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    lines: list[str] = []
    current = ""
    for word in text.split():
        if current and len(indent) + 2 + len(current) + 1 + len(word) > width:
            lines.append(f"{indent}# {current}")
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(f"{indent}# {current}")
    return lines


def _scalar(value: Any) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return dumped.removesuffix("\n...").removesuffix("...").strip()


def _emit_model(model: BaseModel, indent: str, top: bool) -> list[str]:
    out: list[str] = []
    fields: dict[str, FieldInfo] = type(model).model_fields
    for index, (name, info) in enumerate(fields.items()):
        key = info.alias or name
        value = getattr(model, name)
        if index or not top:
            out.append("")
        if isinstance(value, BaseModel):
            if top:
                out.append(f"# +docs:section={key}")
            out.extend(_comment(info.description or "", indent))
            out.append(f"{indent}{key}:")
            out.extend(_emit_model(value, indent + "  ", top=False)[1:])
            continue
        out.extend(_comment(info.description or "", indent))
        for example in info.examples or []:
            out.append(f"{indent}# Example: {_scalar(example)}")
        out.append(f"{indent}# +docs:property")
        dumped = value if not isinstance(value, BaseModel) else value.model_dump(by_alias=True)
        if isinstance(dumped, dict | list) and dumped:
            block = yaml.safe_dump({key: dumped}, default_flow_style=False, sort_keys=False)
            out.extend(f"{indent}{line}" for line in block.rstrip("\n").split("\n"))
        else:
            out.append(f"{indent}{key}: {_scalar(dumped)}")
    return out


def values_yaml() -> str:
    """The text of values.yaml for the model's defaults."""
    lines = _emit_model(Values(), "", top=True)
    return _HEADER + "\n" + "\n".join(lines) + "\n"


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            merged = {**_inline(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
            return _inline(merged, defs)
        return {
            k: " ".join(v.split()) if k == "description" and isinstance(v, str) else _inline(v, defs)
            for k, v in node.items()
            if k != "title"
        }
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


def values_schema() -> dict[str, Any]:
    """values.schema.json: the model's JSON schema with every reference inlined (one readable tree)."""
    schema = Values.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    inlined: dict[str, Any] = _inline(schema, defs)
    # Properties absent from a values file take the defaults of values.yaml, so nothing is required.
    return {"$schema": "http://json-schema.org/draft-07/schema#", **inlined}


def _render_schema() -> str:
    return json.dumps(values_schema(), indent=2, sort_keys=False) + "\n"


def rbac_rules() -> str:
    """files/rbac-rules.yaml: the operator's declared rules by group; the RBAC templates pick groups."""
    groups = {
        "namespaced": rbac.NAMESPACED,
        "crdScanning": rbac.CRD_SCANNING,
        "namespaceScanning": rbac.NAMESPACE_SCANNING,
        "peeringCluster": rbac.PEERING_CLUSTER,
        "peeringNamespaced": rbac.PEERING_NAMESPACED,
        "leaderElection": rbac.LEADER_ELECTION,
    }
    body = {key: [rule.as_policy_rule() for rule in rules] for key, rules in groups.items()}
    header = (
        "# GENERATED from operator/src/carpool/operator/rbac.py by `python -m charts.generate`: the API\n"
        "# permissions the operator declares it needs. templates/rbac/ grants them; do not edit here.\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=110)


def outputs() -> dict[Path, str]:
    """Every generated file and the text it should hold."""
    files = {VALUES_YAML: values_yaml(), VALUES_SCHEMA: _render_schema(), RBAC_RULES: rbac_rules()}
    if CRD_SOURCE.exists():  # Helm reads only the chart's folder, so the CRD is copied in, not linked.
        files[CRD_COPY] = CRD_SOURCE.read_text()
    return files


def stale() -> list[Path]:
    """Generated files whose text on disk differs from what the model gives."""
    return [path for path, text in outputs().items() if not path.exists() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m charts.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when a generated file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        outdated = stale()
        for path in outdated:
            sys.stderr.write(f"out of date: {path} (run python -m charts.generate)\n")
        return 1 if outdated else 0
    for path, text in outputs().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
