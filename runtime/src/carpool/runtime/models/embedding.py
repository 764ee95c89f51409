"""Sentence embeddings: an encoder's token states pooled into one vector per input.

Matches sentence-transformers: the pooling mode and normalisation come from the model folder's
`modules.json` and `1_Pooling/config.json` when present, and the input limit from
`sentence_bert_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModel

from carpool.runtime.config import ModelConfig, Pooling, Task
from carpool.runtime.models.base import EngineInfo
from carpool.runtime.models.encoder import (
    EncoderBatching,
    EncoderEngine,
    load_model,
    load_tokenizer,
    model_max_tokens,
    read_json,
)
from carpool.runtime.models.packed import first_tokens, mean_pool, position_offset
from carpool.runtime.sources import ResolvedSource, SourceKind


def sentence_transformers_layout(folder: str) -> tuple[Pooling | None, bool | None, int | None]:
    """(pooling, normalize, max_seq_length) as a sentence-transformers folder declares them, else Nones."""
    try:
        modules = json.loads((Path(folder) / "modules.json").read_text())
    except (OSError, ValueError):
        modules = []
    pooling: Pooling | None = None
    normalize: bool | None = False if modules else None
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            settings = read_json(str(Path(folder) / str(module.get("path", ""))), "config.json") or {}
            pooling = Pooling.CLS if settings.get("pooling_mode_cls_token") else Pooling.MEAN
    bert = read_json(folder, "sentence_bert_config.json") or {}
    max_seq = bert.get("max_seq_length")
    return pooling, normalize, max_seq if isinstance(max_seq, int) else None


class EmbeddingEngine(EncoderEngine):
    """Embeds texts with mean (or CLS) pooling and optional L2 normalisation."""

    def __init__(
        self, source: ResolvedSource, config: ModelConfig, name: str, device: torch.device, dtype: torch.dtype
    ) -> None:
        tokenizer = load_tokenizer(source, config)
        self._batching = EncoderBatching(tokenizer, device)
        self.model = load_model(AutoModel, source, config, device, dtype)
        declared_pooling, declared_normalize, declared_max = (
            sentence_transformers_layout(source.location)
            if source.kind is not SourceKind.HUB
            else (None, None, None)
        )
        self.pooling = (
            config.pooling if config.pooling is not Pooling.AUTO else (declared_pooling or Pooling.MEAN)
        )
        self.normalize = config.normalize if config.normalize is not None else bool(declared_normalize)
        limit = model_max_tokens(self.model.config, tokenizer, declared_max)
        self._position_offset = position_offset(self.model.config)
        self._cuda_graphs = config.cuda_graphs
        packed = self._batching.enable_packing(
            self.model,
            config.packing,
            lambda batch: self._padded_rows(self._batching.collate(batch)),
            self._embed_packed,
        )
        self._info = EngineInfo(
            name=name,
            task=Task.EMBED,
            max_input_tokens=min(config.max_input_tokens or limit, limit),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            source=config.source,
            dimensions=int(self.model.config.hidden_size),
            packed=packed,
        )

    def _padded_rows(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to embeddings, on the device: what a CUDA graph captures."""
        states: torch.Tensor = self.model(**inputs).last_hidden_state
        if self.pooling is Pooling.CLS:
            return self._normalized(states[:, 0])
        weights = inputs["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled: torch.Tensor = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return self._normalized(pooled)

    def _eager_rows(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._embed_packed(batch) if self._info.packed else super()._eager_rows(batch)

    def _embed_packed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Embeddings of the inputs laid end to end (see `models.packed`): [inputs, hidden]."""
        row = self._batching.pack(batch, self._position_offset)
        states: torch.Tensor = self.model(**row.inputs, packed_segments=row.segments).last_hidden_state[0]
        pooled = first_tokens(states, row) if self.pooling is Pooling.CLS else mean_pool(states, row)
        return self._normalized(pooled)

    def _normalized(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled
