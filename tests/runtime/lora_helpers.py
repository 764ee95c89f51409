"""Building PEFT LoRA adapters for tests: random non-zero weights, saved in PEFT's own format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from torch import nn


def make_adapter(
    base: nn.Module,
    folder: Path,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: float | None = None,
    scale: float = 0.05,
    **options: object,
) -> Path:
    """Save a LoRA adapter of `base` to `folder`; lora_B is random (peft starts it at zero, a no-op)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, **options)  # type: ignore[arg-type]
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(str(folder))
    peft_model.unload()  # take the LoRA layers out of `base` again, leaving its weights as they were
    return folder


def merged(base: nn.Module, folder: Path) -> nn.Module:
    """`base` (modified in place) with the adapter in `folder` merged into its weights."""
    model: nn.Module = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    return model


SMOLLM2_LAYERS = 30
SMOLLM2_SHAPES = {  # (in, out) of SmolLM2-135M's projections
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (576, 192),
    "self_attn.v_proj": (576, 192),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (576, 1536),
    "mlp.up_proj": (576, 1536),
    "mlp.down_proj": (1536, 576),
}


def write_adapter(folder: Path, rank: int, targets: list[str], seed: int, scale: float = 0.05) -> str:
    """A PEFT LoRA folder for SmolLM2 written directly (no model needed), random non-zero weights."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(SMOLLM2_LAYERS):
        for module, (fan_in, fan_out) in SMOLLM2_SHAPES.items():
            if module.rsplit(".", 1)[-1] not in targets:
                continue
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)
