"""Sequence classification: any `AutoModelForSequenceClassification` folder; outputs class probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from carpool.runtime.config import ModelConfig, Task
from carpool.runtime.engines.base import EngineInfo, TextSpec
from carpool.runtime.engines.buckets import Bucket
from carpool.runtime.engines.device import inference
from carpool.runtime.engines.encoder import EncoderBatching, load_model, load_tokenizer, model_max_tokens
from carpool.runtime.engines.graphs import Capture, EncoderGraphs, Timer, prepare_graphs
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
        self._cuda_graphs = config.cuda_graphs
        self._graphs: EncoderGraphs | None = None
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

    def prepare(
        self, buckets: Sequence[Bucket], capture: Capture | None = None, timer: Timer | None = None
    ) -> None:
        """Capture a CUDA graph per bucket where `model.cuda_graphs` asks for them (see `engines.graphs`);
        called once by the loader, before warm-up. `capture` and `timer` stand in for CUDA's in tests."""
        self._graphs = prepare_graphs(
            self._cuda_graphs,
            False,  # classification batches are always padded
            buckets,
            lambda capture: EncoderGraphs(
                self._scores, self._batching.collate_host, capture, self._batching.device
            ),
            lambda batch: self._scores(self._batching.collate(batch)).cpu(),
            self._batching.dummy_input,
            self._batching.device,
            capture,
            timer,
        )

    @property
    def graphs(self) -> EncoderGraphs | None:
        """The captured graphs, when batches replay them."""
        return self._graphs

    def forward(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        try:
            with inference(self._batching.device):
                replayed = self._graphs.run(batch) if self._graphs is not None else None
                rows: np.ndarray[Any, Any]
                if replayed is not None:
                    # The replay's rows live in the graph's static outputs: copy them before the next batch.
                    rows = replayed.to("cpu", copy=True).numpy()
                else:
                    rows = self._scores(self._batching.collate(batch)).cpu().numpy()
        except Exception as exc:
            self._batching.guard_memory(exc)
            raise
        return list(rows)

    def _scores(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to label probabilities (float32), on the device: what a CUDA graph captures."""
        logits = self.model(**inputs).logits.float()
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
