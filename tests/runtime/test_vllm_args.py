"""carpool's settings as vLLM's engine arguments (`vllm.args`, pure: no vLLM here): on a GPU what the user
leaves unset is left to vLLM, which resolves it as its own OpenAI server does for the device; carpool's
CPU-minded defaults apply on CPU only; the KV cache in tokens becomes vLLM's per-GPU bytes under tensor and
pipeline parallelism; quantization reaches vLLM or is refused by name; settings vLLM ignores are listed.
What vLLM itself resolves from these arguments is checked in vLLM's environment (tests/vllm/test_release.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from carpool.runtime.config import ConfigError
from carpool.runtime.vllm.args import (
    ModelFacts,
    engine_args,
    facts_of,
    gguf_model,
    ignored_settings,
    kv_bytes_per_token,
    read_facts,
)
from tests.runtime.factories import runtime_config

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "max_position_embeddings": 131072,
}
SERVER_DEFAULTS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes")
"""What vLLM's server resolves per device when nothing is passed (gpu_memory_utilization is never passed)."""


def generate(**sections: dict[str, Any]) -> dict[str, Any]:
    model = {"source": "x", "task": "generate", **sections.pop("model", {})}
    return {"model": model, **sections}


def test_on_a_gpu_what_the_user_leaves_unset_is_left_to_vllms_server_defaults() -> None:
    facts = facts_of(LLAMA_70B)
    config = runtime_config(**generate(model={"tensor_parallel_size": 8}))
    args = engine_args(config, "/m", "cuda", False, facts)
    assert not set(SERVER_DEFAULTS) & set(args), {k: args[k] for k in SERVER_DEFAULTS if k in args}
    assert "gpu_memory_utilization" not in args and "quantization" not in args
    # What the user sets is passed as set.
    chosen = runtime_config(
        **generate(generation={"max_running_sequences": 48, "max_step_tokens": 4096, "max_model_len": 16384})
    )
    args = engine_args(chosen, "/m", "cuda", False, facts)
    assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["max_model_len"]) == (48, 4096, 16384)


def test_on_cpu_carpools_own_defaults_apply() -> None:
    """vLLM's CPU server would reserve 92% of the host for the KV cache and serve the model's whole
    context: carpool keeps a context of at most 2048 and a 1 GiB cache there; the sequence limit and
    the step budget are vLLM's server's (128, 2048 per rank), not carpool's engine's 16."""
    args = engine_args(runtime_config(**generate()), "/m", "cpu", True, facts_of(LLAMA_70B))
    assert (args["max_model_len"], args["kv_cache_memory_bytes"]) == (2048, 1024**3)
    assert "max_num_batched_tokens" not in args and "max_num_seqs" not in args


@pytest.mark.parametrize(
    ("tensor", "pipeline", "heads", "layers"),
    [(1, 1, 8, 80), (8, 1, 1, 80), (4, 2, 2, 40), (16, 1, 1, 80), (1, 3, 8, 27)],
)
def test_the_kv_cache_in_tokens_is_sized_per_gpu(tensor: int, pipeline: int, heads: int, layers: int) -> None:
    """vLLM takes `kv_cache_memory_bytes` per GPU: each rank holds its KV heads (at least one) of its
    stage's layers for every token, so tensor parallel 8 must not reserve 8 times what was asked."""
    facts = facts_of(LLAMA_70B)
    config = runtime_config(
        **generate(
            model={"tensor_parallel_size": tensor, "pipeline_parallel_size": pipeline},
            generation={"kv_cache_tokens": 100_000},
        )
    )
    args = engine_args(config, "/m", "cuda", False, facts)
    head_dim = 8192 // 64
    assert args["kv_cache_memory_bytes"] == 100_000 * 2 * 2 * layers * heads * head_dim
    assert kv_bytes_per_token(facts, "float32", tensor, pipeline) == 2 * kv_bytes_per_token(
        facts, "bfloat16", tensor, pipeline
    )


def test_kv_cache_tokens_without_the_models_shape_is_refused_by_name() -> None:
    config = runtime_config(**generate(generation={"kv_cache_tokens": 1000}))
    with pytest.raises(ConfigError, match=r"generation\.kv_cache_tokens.*kv_cache_memory_bytes"):
        engine_args(config, "/m", "cuda", False, ModelFacts())


def test_quantization_reaches_vllm_or_is_refused_by_name() -> None:
    plain = facts_of(LLAMA_70B)
    fp8 = engine_args(runtime_config(**generate(model={"quantization": "fp8"})), "/m", "cuda", False, plain)
    assert fp8["quantization"] == "fp8"
    # A checkpoint's own (AWQ, GPTQ, FP8): vLLM reads its quantization_config and picks its fastest
    # kernel (awq_marlin over awq), which naming the method would forbid: nothing passed, the facts say it.
    awq = facts_of({**LLAMA_70B, "quantization_config": {"quant_method": "awq", "bits": 4}})
    assert awq.quantization == "awq"
    assert "quantization" not in engine_args(runtime_config(**generate()), "/m", "cuda", False, awq)
    with pytest.raises(ConfigError, match="already quantized with awq"):
        engine_args(runtime_config(**generate(model={"quantization": "fp8"})), "/m", "cuda", False, awq)
    for method in ("int4", "int8"):
        with pytest.raises(ConfigError, match=rf"model\.quantization {method}: vLLM does not quantize"):
            engine_args(
                runtime_config(**generate(model={"quantization": method})), "/m", "cuda", False, plain
            )


def test_settings_vllm_ignores_are_named_where_they_were_set() -> None:
    assert ignored_settings(runtime_config(**generate())) == []
    config = runtime_config(
        **generate(
            model={"torch_threads": 4},
            generation={"kv_block_size": 32, "max_running_sequences": 8},
            batching={"max_batch_size": 8, "max_queue_size": 10},
        )
    )
    named = ignored_settings(config)
    assert [entry.split(" ")[0] for entry in named] == [
        "generation.kv_block_size",
        "model.torch_threads",
        "batching.max_batch_size",
    ], named


def test_a_gguf_is_served_natively_with_its_folders_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert gguf_model(str(tmp_path), "model.Q4_K_M.gguf") == {"model": str(tmp_path / "model.Q4_K_M.gguf")}
    (tmp_path / "tokenizer.json").write_text("{}")
    assert gguf_model(str(tmp_path), "model.Q4_K_M.gguf")["tokenizer"] == str(tmp_path)


def test_model_facts_come_from_config_json(tmp_path: Path) -> None:
    assert read_facts(str(tmp_path)) == ModelFacts()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": LLAMA_70B}))
    facts = read_facts(str(tmp_path))
    assert (facts.context, facts.layers, facts.kv_heads, facts.head_dim) == (131072, 80, 8, 128)
