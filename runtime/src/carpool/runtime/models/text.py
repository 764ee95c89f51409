"""What the fronts need of a model's tokenizer, taken from the transformers tokenizer the engine loaded.

The fronts tokenize and detokenize without transformers or torch: they rebuild the same fast tokenizer
from its JSON (`tokenizers.Tokenizer.from_str`) and render the chat template with Jinja as transformers
does. Truncation and padding are switched off, as the engine's own `tokenize` calls do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from carpool.runtime.config import ConfigError
from carpool.runtime.tokenizer import tokenizer_json
from carpool.runtime.wire import TextSpec


def text_spec(
    tokenizer: Any,
    eos_ids: Iterable[int] = (),
    max_model_len: int = 0,
    chat: bool = False,
    cache_tokens: int = 0,
    sampling_defaults: dict[str, float] | None = None,
    vocab_size: int = 0,
) -> TextSpec:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"{type(tokenizer).__name__} is a slow (Python) tokenizer; carpool's fronts need a fast one "
            "(a tokenizer.json in the model folder)"
        )
    special = {name: value for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)}
    template = getattr(tokenizer, "chat_template", None) if chat else None
    return TextSpec(
        tokenizer_json=tokenizer_json(backend),
        chat_template=template if isinstance(template, str) else None,
        special_tokens=special,
        eos_ids=sorted(eos_ids),
        max_model_len=max_model_len,
        cache_tokens=cache_tokens,
        sampling_defaults=dict(sampling_defaults or {}),
        vocab_size=vocab_size,
    )


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation-config settings the fronts apply where a request is silent (vLLM's server applies
these and `max_new_tokens`)."""


def sampling_defaults(diff: dict[str, Any]) -> dict[str, float]:
    """From a model's generation config, as set in its `generation_config.json` (transformers'
    `GenerationConfig.to_diff_dict()`, or vLLM's `get_diff_sampling_param()`), the sampling defaults
    the fronts apply."""
    return {name: float(diff[name]) for name in SAMPLING_DEFAULTS if diff.get(name) is not None}
