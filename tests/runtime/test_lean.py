"""carpool's own decoder step (`models.lean`) against transformers' forward on the same weights.

Tiny random Llama, Qwen2 (q/k/v biases) and Mistral decoders, driven through the real iteration scheduler
with prompt chunks and decodes in the same steps: every step's logits must equal transformers' to float32
rounding and every sampled token must be the same. The real SmolLM2 is compared in
test_generation.py (`test_one_paged_forward_...`, parametrized over both decoders).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from carpool.runtime.batching.continuous import (
    BlockAllocator,
    IterationPolicy,
    IterationScheduler,
    Sequence,
)
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import Decoder, DType, GenerationConfig, ModelConfig, Task
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.models.lean import supports
from carpool.runtime.models.paged import sliding_window
from carpool.runtime.sources import resolve_source
from tests.runtime.lora_helpers import TINY, TOKENIZER_FILES, tiny_generator
from tests.runtime.steps import drive, record_logits

MODELS: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "mistral": MistralForCausalLM,
}


def engine(folder: Path, decoder: Decoder) -> GenerationEngine:
    config = ModelConfig(source=str(folder), task=Task.GENERATE, dtype=DType.FLOAT32)
    generation = GenerationConfig(kv_cache_tokens=2048, max_model_len=256, kv_block_size=4, decoder=decoder)
    return GenerationEngine(
        resolve_source(str(folder)), config, generation, "tiny", torch.device("cpu"), torch.float32
    )


def run(engine: GenerationEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Six prompts of different lengths through the scheduler, 8 tokens each, at most 24 tokens a step
    (so prompts are prefilled in chunks beside running decodes); every step's tokens and logits."""
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=6, max_step_tokens=24),
        RequestQueue(64, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
    )
    for i in range(6):
        prompt = [(7 * i + 3 * j) % 30000 + 100 for j in range(5 + 9 * i)]
        scheduler.submit(Sequence(tokens=prompt, arrival=0.0, deadline=float("inf"), max_tokens=8), 0.0)
    logits = record_logits(engine)
    tokens, _ = drive(engine, scheduler)
    return tokens, logits


@pytest.mark.parametrize("kind", list(MODELS))
def test_lean_steps_equal_transformers_forward(kind: str, tmp_path: Path) -> None:
    folder = tiny_generator(tmp_path / kind, seed=3, model=MODELS[kind])
    lean, reference = engine(folder, Decoder.AUTO), engine(folder, Decoder.TRANSFORMERS)
    assert lean.lean is not None and reference.lean is None
    lean_tokens, lean_logits = run(lean)
    tokens, logits = run(reference)
    assert len(tokens) > 8 and any(len(step) > 1 for step in tokens)
    assert lean_tokens == tokens
    for mine, theirs in zip(lean_logits, logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def _cuda_layout(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`scaled_dot_product_attention` returning its output as CUDA's flash and memory-efficient kernels do:
    [batch, heads, length, dim] stored as [batch, length, heads, dim] (a transposed view). No CPU kernel
    returns that layout, so this stands in for the GPU here: on an H100 (2026-11-26) a `.view` of such an
    output stopped the engine at its first step ("view size is not compatible with input tensor's size and
    stride")."""

    def transposed(*args: Any, **kwargs: Any) -> torch.Tensor:
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    return transposed


@pytest.mark.parametrize("decoder", [Decoder.AUTO, Decoder.TRANSFORMERS])
def test_steps_take_attention_outputs_in_the_cuda_kernels_layout(
    decoder: Decoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_generator(tmp_path / "llama", seed=3, model=LlamaForCausalLM)
    expected_tokens, expected_logits = run(engine(folder, decoder))
    monkeypatch.setattr(F, "scaled_dot_product_attention", _cuda_layout(F.scaled_dot_product_attention))
    tokens, logits = run(engine(folder, decoder))
    assert tokens == expected_tokens
    for mine, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_qwen2_biases_are_fused_with_their_projections(tmp_path: Path) -> None:
    """Qwen2's q/k/v carry biases: the fused projection must add each to its own rows."""
    folder = tiny_generator(tmp_path / "qwen2", seed=5, model=Qwen2ForCausalLM)
    built = engine(folder, Decoder.AUTO)
    attn = built.model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() == 0  # transformers' init: zeros
    with torch.no_grad():  # give the biases weight, through the views the fusion left in the modules
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.bias.normal_(0.0, 1.0)
    x = torch.randn(3, TINY["hidden_size"])
    q, k, v = built.lean.layers[0].qkv(x)  # type: ignore[union-attr]
    torch.testing.assert_close(q, attn.q_proj(x))
    torch.testing.assert_close(k, attn.k_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))


def test_fused_weights_are_the_models_own_not_copies(tmp_path: Path) -> None:
    folder = tiny_generator(tmp_path / "llama", seed=1)
    built = engine(folder, Decoder.AUTO)
    layer = built.model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert attn.v_proj.weight.untyped_storage().data_ptr() == storage
    gate = mlp.gate_proj.weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate


def test_models_lean_does_not_know_keep_transformers_forward(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert supports(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2))) is not None
    windowed = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert supports(Qwen2ForCausalLM(windowed)) == "sliding-window attention"
    folder = tiny_generator(tmp_path / "llama", seed=1)
    with caplog.at_level(logging.INFO, logger="carpool.runtime.models.generation"):
        built = engine(folder, Decoder.TRANSFORMERS)
    assert built.lean is None
    assert "steps run on transformers' forward: generation.decoder is transformers" in caplog.text


def test_a_sliding_window_shorter_than_the_context_caps_the_context(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Paged attention (either decoder) attends to a sequence's whole context: for a model that attends
    within a window, the context is capped at the window, where the two are the same."""
    from transformers import MistralConfig

    folder = tmp_path / "windowed"
    MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": 32})).save_pretrained(str(folder))
    # transformers' default window (4096) is longer than the tiny model's 512 positions: no window in effect
    plain = tiny_generator(tmp_path / "plain", seed=1, model=MistralForCausalLM)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((plain / name).read_bytes())
    with caplog.at_level(logging.WARNING, logger="carpool.runtime.models.generation"):
        windowed = engine(folder, Decoder.AUTO)
    assert windowed.max_model_len == 32 and windowed.lean is None
    assert "sliding window of 32 tokens" in caplog.text
    assert engine(plain, Decoder.AUTO).max_model_len == 256
    qwen = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert sliding_window(qwen) == 64
    assert sliding_window(Qwen2Config(**TINY)) is None
