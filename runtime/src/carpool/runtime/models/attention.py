"""Registering carpool's attention functions with transformers and switching a model to one of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def register(name: str, function: Callable[..., Any]) -> None:
    """Make `function` available as `attn_implementation=name`, with SDPA-style masks."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def use(model: PreTrainedModel, name: str) -> bool:
    """Make `model` attend with the function registered as `name`; False when it cannot take a custom
    attention function (it then keeps its own)."""
    try:
        model.set_attn_implementation(name)  # warns and keeps its own when it cannot
    except (ValueError, NotImplementedError):
        return False
    return bool(model.config._attn_implementation == name)
