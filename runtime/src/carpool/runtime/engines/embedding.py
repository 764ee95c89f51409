"""Sentence embeddings: an encoder's token states pooled into one vector per input.

Matches sentence-transformers: the pooling mode and normalisation come from the model folder's
`modules.json` and `1_Pooling/config.json` when present, and the input limit from
`sentence_bert_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel

from carpool.runtime.config import ModelConfig, Pooling, Task
from carpool.runtime.engines.base import EngineInfo, TextSpec
from carpool.runtime.engines.buckets import Bucket
from carpool.runtime.engines.device import inference
from carpool.runtime.engines.encoder import (
    EncoderBatching,
    load_model,
    load_tokenizer,
    model_max_tokens,
    read_json,
)
from carpool.runtime.engines.graphs import Capture, EncoderGraphs, Timer, prepare_graphs
from carpool.runtime.engines.packed import first_tokens, mean_pool, position_offset
from carpool.runtime.engines.text import text_spec
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


class EmbeddingEngine:
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
        self._graphs: EncoderGraphs | None = None
        packed = self._batching.enable_packing(
            self.model, config.packing, self._embed_padded, self._embed_packed
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
            self._info.packed,
            buckets,
            lambda capture: EncoderGraphs(
                self._pool_padded, self._batching.collate_host, capture, self._batching.device
            ),
            lambda batch: self._embed_padded(batch).float().cpu(),
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
                    rows = replayed.float().to("cpu", copy=True).numpy()
                elif self._info.packed:
                    rows = self._embed_packed(batch).float().cpu().numpy()
                else:
                    rows = self._embed_padded(batch).float().cpu().numpy()
        except Exception as exc:
            self._batching.guard_memory(exc)
            raise
        return list(rows)

    def _embed_padded(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Embeddings of a padded batch: [inputs, hidden]."""
        return self._pool_padded(self._batching.collate(batch))

    def _pool_padded(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to embeddings, on the device: what a CUDA graph captures."""
        states: torch.Tensor = self.model(**inputs).last_hidden_state
        if self.pooling is Pooling.CLS:
            return self._normalized(states[:, 0])
        weights = inputs["attention_mask"].unsqueeze(-1).to(states.dtype)
        pooled: torch.Tensor = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return self._normalized(pooled)

    def _embed_packed(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """Embeddings of the inputs laid end to end (see `engines.packed`): [inputs, hidden]."""
        row = self._batching.pack(batch, self._position_offset)
        states: torch.Tensor = self.model(**row.inputs, packed_segments=row.segments).last_hidden_state[0]
        pooled = first_tokens(states, row) if self.pooling is Pooling.CLS else mean_pool(states, row)
        return self._normalized(pooled)

    def _normalized(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled
