"""The null engine: a model's tokenizer and output shape, and zeros for outputs (`model.engine: zeros`).

It exists to measure everything in front of the model: HTTP, validation, tokenization, queueing and JSON,
with no forward pass to hide them (bench `--front-only`), and to load-test the path to the pods without a
GPU. It reads the source's `tokenizer.json` (through `tokenizers`: no torch, no transformers, so a
process serving it never imports torch) and `config.json`, so requests are tokenized, limited and shaped
exactly as the real model's: an embedding has the model's width (`hidden_size`), a classification one
probability per label. Every output is zeros, computed at once.

A device stand-in for benchmarks of what lies around the pods (autoscaling on a real control plane,
tests/cluster/bench_autoscaling.py): with `NULL_ENGINE_COST="FIXED,PER_TOKEN"` in its environment (seconds
a batch, seconds a token), a batch takes that long, asleep, as on a device of that speed, and a pod's
capacity no longer depends on the host's cores (a dozen pods on two cores serve a dozen pods' load).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carpool.runtime.config import ConfigError, ModelConfig, Task
from carpool.runtime.models.base import EngineInfo, TextSpec
from carpool.runtime.sources import SourceKind, resolve_source
from carpool.runtime.tokenizer import TextTokenizer, read_json

_FALLBACK_MAX_TOKENS = 512

COST_ENV = "NULL_ENGINE_COST"
"""`FIXED,PER_TOKEN`: seconds a batch takes, and seconds each of its tokens adds (a device stand-in)."""


def device_cost(value: str | None) -> tuple[float, float]:
    """(seconds a batch, seconds a token) from `COST_ENV`'s value; (0, 0) without one."""
    if not value:
        return 0.0, 0.0
    try:
        fixed, per_token = (float(part) for part in value.split(","))
    except ValueError as exc:
        raise ConfigError(f"{COST_ENV}={value!r}: expected two numbers, seconds a batch and a token") from exc
    if fixed < 0 or per_token < 0:
        raise ConfigError(f"{COST_ENV}={value!r}: the costs must not be negative")
    return fixed, per_token


def declared_max_tokens(folder: Path) -> int:
    """The longest input the model takes, as its files declare it: the smallest of the sentence-transformers
    `max_seq_length`, `max_position_embeddings` and the tokenizer's `model_max_length` (as the transformers
    engines compute it)."""
    limits: list[int] = []
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        value = read_json(folder, name).get(key)
        if isinstance(value, int) and 0 < value < 1_000_000:
            limits.append(value)
    return min(limits) if limits else _FALLBACK_MAX_TOKENS


def _labels(model_json: dict[str, Any]) -> list[str]:
    id2label = model_json.get("id2label") or {}
    count = int(model_json.get("num_labels") or len(id2label) or 2)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


class NullEngine:
    """Answers every input with zeros of the served model's output shape; `forward` does no work."""

    def __init__(self, config: ModelConfig, name: str) -> None:
        if config.task is Task.GENERATE:
            raise ConfigError(
                "model.engine zeros serves task embed or classify; task generate needs model.engine "
                "carpool, vllm or auto"
            )
        source = resolve_source(config.source)
        if source.kind is SourceKind.HUB:
            raise ConfigError(
                f"model.engine zeros reads the tokenizer and shape from a local folder or `pkg:` source; "
                f"{config.source!r} is a hub repo id"
            )
        folder = Path(source.location)
        model_json = read_json(folder, "config.json")
        self._tokenizer = TextTokenizer.from_folder(folder)
        limit = declared_max_tokens(folder)
        width: int
        labels: list[str]
        if config.task is Task.EMBED:
            hidden = model_json.get("hidden_size")
            if not isinstance(hidden, int) or hidden < 1:
                raise ConfigError(f"{folder}/config.json declares no hidden_size: the embedding width")
            width, labels = hidden, []
        elif config.task is Task.RERANK:
            width, labels = 1, []  # one score per pair
        else:
            labels = _labels(model_json)
            width = len(labels)
        self._zeros = np.zeros(width, dtype=np.float32)
        self._zeros.flags.writeable = False  # one row shared by every answer: nobody may change it
        self._info = EngineInfo(
            name=name,
            task=config.task,
            max_input_tokens=min(config.max_input_tokens or limit, limit),
            device="none",
            dtype="float32",
            source=config.source,
            dimensions=width if config.task is Task.EMBED else None,
            labels=labels,
            packed=True,  # a batch costs nothing, padding included: no reason to group lengths
        )
        specials = self._tokenizer.special_ids()
        self._filler = next((i for i in range(1000, 2000) if i not in specials), 0)
        self._cost = device_cost(os.environ.get(COST_ENV))

    @property
    def info(self) -> EngineInfo:
        return self._info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tokenizer.encode(texts)

    def text_spec(self) -> TextSpec:
        """The same `tokenizer.json` for the fronts, which tokenize the requests (encoders: no chat)."""
        return TextSpec(tokenizer_json=self._tokenizer.to_json())

    def dummy_input(self, length: int) -> list[int]:
        template = self.tokenize(["x"])[0]
        if length <= len(template):
            return template[:length]
        return template[:1] + [self._filler] * (length - len(template)) + template[1:]

    def forward(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        fixed, per_token = self._cost
        if fixed or per_token:
            time.sleep(fixed + per_token * sum(len(item) for item in batch))
        return [self._zeros] * len(batch)

    def release_memory(self) -> None:
        pass
