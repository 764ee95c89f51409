"""Sequence classification: any `AutoModelForSequenceClassification` folder; outputs class probabilities,
or, for a cross-encoder (task `rerank`), one relevance score per query-document pair.

A cross-encoder is a sequence classifier with one label that reads a text pair: the score is its logit
through the activation sentence-transformers' `CrossEncoder` applies (the folder's declared one, else a
sigmoid), so carpool's scores are `CrossEncoder.predict`'s. `model.task: rerank` asks for that; with
`classify`, a folder that sentence-transformers saved as a `CrossEncoder` with one label is served as
rerank (a one-label softmax would answer 1.0 to everything), and nothing else is guessed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from carpool.runtime.config import ConfigError, ModelConfig, Task
from carpool.runtime.models.base import EngineInfo
from carpool.runtime.models.encoder import (
    EncoderBatching,
    EncoderEngine,
    load_model,
    load_tokenizer,
    model_max_tokens,
    read_json,
)
from carpool.runtime.sources import ResolvedSource, SourceKind

log = logging.getLogger(__name__)

_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda logits: logits,
    "torch.nn.Identity": lambda logits: logits,
}
"""The activations of sentence-transformers cross-encoders that carpool applies, by the import path the
folder declares."""


def cross_encoder_activation(folder: str) -> tuple[bool, str | None]:
    """(whether sentence-transformers saved `folder` as a CrossEncoder, the activation it declares): in
    `config_sentence_transformers.json` (v6 on), `config.json`'s `sentence_transformers` (v4, v5) or its
    `sbert_ce_default_activation_function` (before v4)."""
    settings = read_json(folder, "config_sentence_transformers.json") or {}
    if settings.get("model_type") == "CrossEncoder":
        return True, settings.get("activation_fn")
    model_json = read_json(folder, "config.json") or {}
    declared = model_json.get("sentence_transformers")
    if isinstance(declared, dict) and "activation_fn" in declared:
        return True, declared.get("activation_fn")
    if "sbert_ce_default_activation_function" in model_json:
        return True, model_json.get("sbert_ce_default_activation_function")
    return False, None


class ClassificationEngine(EncoderEngine):
    """Returns, per input, the probabilities of each label (softmax; sigmoid for multi-label models), or
    for a cross-encoder (task rerank) the relevance score of each text pair."""

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
        saved_as, activation = (
            cross_encoder_activation(source.location) if source.kind is not SourceKind.HUB else (False, None)
        )
        task = config.task
        if task is Task.CLASSIFY and saved_as and len(labels) == 1:
            log.info(
                "%s is a sentence-transformers CrossEncoder of one label: served as rerank (POST /v1/rerank)",
                config.source,
            )
            task = Task.RERANK
        self._score: Any = None
        if task is Task.RERANK:
            self._score = _scorer(config.source, len(labels), activation)
            labels = []
        limit = model_max_tokens(model_config, tokenizer, None)
        self._cuda_graphs = config.cuda_graphs
        self._info = EngineInfo(
            name=name,
            task=task,
            max_input_tokens=min(config.max_input_tokens or limit, limit),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            source=config.source,
            labels=labels,
        )

    def _padded_rows(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to label probabilities, or pair scores [n, 1] (float32), on the device:
        what a CUDA graph captures."""
        logits = self.model(**inputs).logits.float()
        if self._score is not None:
            return self._score(logits)  # type: ignore[no-any-return]
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)


def _scorer(source: str, labels: int, activation: str | None) -> Any:
    """The activation turning a cross-encoder's one logit into its score, as sentence-transformers'."""
    if labels != 1:
        raise ConfigError(
            f"model.task rerank needs a cross-encoder with one output (num_labels 1); {source} has {labels}"
        )
    if activation is None:
        return torch.sigmoid  # sentence-transformers' default for one label
    score = _ACTIVATIONS.get(activation)
    if score is None:
        raise ConfigError(
            f"{source} declares the cross-encoder activation {activation!r}; carpool applies "
            f"{sorted({path.rsplit('.', 1)[1] for path in _ACTIVATIONS})}"
        )
    return score
