"""Sequence classification: any `AutoModelForSequenceClassification` folder; outputs class probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from carpool.runtime.config import ModelConfig, Task
from carpool.runtime.engines.base import EngineInfo, TextSpec
from carpool.runtime.engines.device import inference
from carpool.runtime.engines.encoder import EncoderBatching, load_model, load_tokenizer, model_max_tokens
from carpool.runtime.engines.text import text_spec
from carpool.runtime.sources import ResolvedSource


class ClassificationEngine:
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
        self._info = EngineInfo(
            name=name,
            task=Task.CLASSIFY,
            max_input_tokens=min(config.max_input_tokens or limit, limit),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            source=config.source,
            labels=labels,
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self._batching.tokenize(texts)

    def text_spec(self) -> TextSpec:
        return text_spec(self._batching.tokenizer)

    def dummy_input(self, length: int) -> list[int]:
        return self._batching.dummy_input(length)

    def release_memory(self) -> None:
        self._batching.release_memory()

    def forward(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        inputs = self._batching.collate(batch)
        try:
            with inference(self._batching.device):
                logits = self.model(**inputs).logits.float()
                scores = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
                rows: np.ndarray[Any, Any] = scores.cpu().numpy()
        except Exception as exc:
            self._batching.guard_memory(exc)
            raise
        return list(rows)
