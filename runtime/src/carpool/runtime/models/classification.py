"""Sequence classification: any `AutoModelForSequenceClassification` folder; outputs class probabilities."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from carpool.runtime.config import ModelConfig, Task
from carpool.runtime.models.base import EngineInfo
from carpool.runtime.models.encoder import (
    EncoderBatching,
    EncoderEngine,
    load_model,
    load_tokenizer,
    model_max_tokens,
)
from carpool.runtime.sources import ResolvedSource


class ClassificationEngine(EncoderEngine):
    """Returns, per input, the probabilities of each label (softmax; sigmoid for multi-label models)."""

    def __init__(
        self, source: ResolvedSource, config: ModelConfig, name: str, device: torch.device, dtype: torch.dtype
    ) -> None:
        tokenizer = load_tokenizer(source, config)
        self._batching = EncoderBatching(tokenizer, device)
        self.model = load_model(AutoModelForSequenceClassification, source, config, device, dtype)
        model_config = self.model.config
        self.multi_label = getattr(model_config, "problem_type", None) == "multi_label_classification"
        id2label = getattr(model_config, "id2label", None) or {}
        labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(int(model_config.num_labels))]
        limit = model_max_tokens(model_config, tokenizer, None)
        self._cuda_graphs = config.cuda_graphs
        self._info = EngineInfo(
            name=name,
            task=Task.CLASSIFY,
            max_input_tokens=min(config.max_input_tokens or limit, limit),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            source=config.source,
            labels=labels,
        )

    def _padded_rows(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to label probabilities (float32), on the device: what a CUDA graph captures."""
        logits = self.model(**inputs).logits.float()
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
