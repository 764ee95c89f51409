"""PEFT LoRA folders with random weights, written directly (no model, no peft needed): for `bench.lora`
and the LoRA tests, so both exercise adapters of the same layout."""

from __future__ import annotations

import json
from pathlib import Path

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


def write_adapter(
    folder: Path,
    rank: int,
    targets: list[str],
    seed: int,
    scale: float = 0.05,
    layers: int = SMOLLM2_LAYERS,
    shapes: dict[str, tuple[int, int]] = SMOLLM2_SHAPES,
    alpha: int | None = None,
) -> str:
    """A PEFT LoRA folder for SmolLM2 (or the model of `shapes`), random non-zero weights times `scale`,
    on the modules named in `targets`; `lora_alpha` defaults to 2 x rank."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in shapes.items():
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
        "lora_alpha": 2 * rank if alpha is None else alpha,
        "target_modules": targets,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)
