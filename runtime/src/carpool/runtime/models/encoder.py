"""Shared plumbing of encoder models: tokenizing, padding a batch into tensors, running on a device."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from carpool.runtime.batching.request import TextPair
from carpool.runtime.config import CudaGraphs, ModelConfig, Packing
from carpool.runtime.errors import OutOfMemory
from carpool.runtime.models import packed, prepacked
from carpool.runtime.models.base import EngineInfo, TextSpec
from carpool.runtime.models.buckets import Bucket
from carpool.runtime.models.device import inference, is_out_of_memory, release_memory
from carpool.runtime.models.graphs import Capture, EncoderGraphs, Timer, prepare_graphs
from carpool.runtime.models.text import text_spec
from carpool.runtime.sources import ResolvedSource, SourceKind

log = logging.getLogger(__name__)

# Texts of different lengths for comparing a packed forward with a padded one at load.
_PACKING_CHECK = [
    "Requests share a ride.",
    "The runtime groups concurrent requests into batches, so the device does in one pass what would "
    "take many, and it exports its queue depth so the cluster can scale on it.",
    "ok",
]


def load_tokenizer(source: ResolvedSource, config: ModelConfig) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        source.location,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        local_files_only=source.kind is not SourceKind.HUB,
    )
    return tokenizer


def load_model(
    auto_class: Any, source: ResolvedSource, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> Any:
    """`auto_class.from_pretrained` on the resolved source, moved to the device, in inference mode; on a
    CPU, its projections packed for oneDNN where that is faster (`models.prepacked`)."""
    model = auto_class.from_pretrained(
        source.location,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        local_files_only=source.kind is not SourceKind.HUB,
        dtype=dtype,
    )
    model = model.to(device).eval()
    if device.type == "cpu":
        log.info("%s", prepacked.describe(prepacked.install(model, probe=prepacked.probe_forward(model))))
    return model


def read_json(folder: str, name: str) -> dict[str, Any] | None:
    path = Path(folder) / name
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def model_max_tokens(model_config: Any, tokenizer: PreTrainedTokenizerBase, declared: int | None) -> int:
    """The longest input the model can take: the smallest of what is declared anywhere."""
    limits = [declared] if declared else []
    positions = getattr(model_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    tokenizer_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_max, int) and 0 < tokenizer_max < 1_000_000:
        limits.append(tokenizer_max)
    return min(limits) if limits else 512


class EncoderBatching:
    """Turns unpadded token ids into padded tensors on the device and runs a callable on them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.device = device
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.uses_token_types = "token_type_ids" in tokenizer.model_input_names
        self._filler = self._filler_token()

    def _filler_token(self) -> int:
        for token_id in range(1000, 2000):
            if token_id not in self.tokenizer.all_special_ids:
                return token_id
        return 0

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        encoded = self.tokenizer(list(texts), add_special_tokens=True, truncation=False, verbose=False)
        return [list(ids) for ids in encoded["input_ids"]]

    def dummy_input(self, length: int) -> list[int]:
        """An input of exactly `length` tokens, shaped like a real one (special tokens at the ends)."""
        template = self.tokenize(["x"])[0]
        if length <= len(template):
            return template[:length]
        return template[:1] + [self._filler] * (length - len(template)) + template[1:]

    def collate(self, batch: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """The batch padded to its longest input, on the device."""
        host = self.collate_host(batch, len(batch), max(len(ids) for ids in batch))
        return {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}

    def collate_host(self, batch: Sequence[Sequence[int]], rows: int, length: int) -> dict[str, torch.Tensor]:
        """The batch padded to exactly `rows` x `length` tokens, on the host. Rows past the batch (a batch
        padded up to a captured graph's size) attend to one pad token, so no row's attention is empty.

        Vectorised: the ids of the whole batch go into one array and land in their rows through one
        mask, a few numpy calls per batch whatever its size (a torch call per row was a third of the
        engine's main thread on an H100, issue 37)."""
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        flat = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.int64, count=int(lengths.sum()))
        positions = np.arange(length)
        real = positions < lengths[:, None]
        input_ids = np.full((rows, length), self.pad_id, dtype=np.int64)
        input_ids[: len(batch)][real] = flat
        mask = np.zeros((rows, length), dtype=np.int64)
        mask[: len(batch)] = real
        mask[len(batch) :, 0] = 1
        tensors = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask)}
        if self.uses_token_types:
            types = np.zeros((rows, length), dtype=np.int64)
            for row, ids in enumerate(batch):
                if isinstance(ids, TextPair):  # a query-document pair: the document's tokens are of type 1
                    types[row, ids.second : len(ids)] = 1
            tensors["token_type_ids"] = torch.from_numpy(types)
        return tensors

    def pack(self, batch: Sequence[Sequence[int]], offset: int) -> packed.PackedRow:
        return packed.pack(batch, self.device, self.uses_token_types, offset)

    def enable_packing(
        self,
        model: Any,
        setting: Packing,
        padded: Callable[[Sequence[Sequence[int]]], torch.Tensor],
        packed_forward: Callable[[Sequence[Sequence[int]]], torch.Tensor],
    ) -> bool:
        """Install packed attention on `model` if `setting` asks for it (auto: on CPU), and keep it only if
        a packed forward of a mixed batch gives what a padded one gives. True when packing is on."""
        wanted = setting is Packing.PACKED or (setting is Packing.AUTO and self.device.type == "cpu")
        if not wanted:
            return False
        before = model.config._attn_implementation
        if not packed.install(model):
            log.info("packed batches: %s takes no custom attention function; batches are padded", type(model))
            return False
        batch = self.tokenize(_PACKING_CHECK)
        with inference(self.device):
            reference, candidate = padded(batch).float(), packed_forward(batch).float()
        scale = float(reference.abs().max().clamp(min=1e-6))
        error = float((reference - candidate).abs().max()) / scale
        tolerance = 1e-4 if model.dtype == torch.float32 else 2e-2
        if error > tolerance:
            model.set_attn_implementation(before)
            log.warning(
                "packed batches: %s gives outputs %.2g off the padded forward (tolerance %.0g); "
                "batches are padded",
                type(model).__name__,
                error,
                tolerance,
            )
            return False
        log.info("packed batches: on (checked against a padded batch: largest difference %.1g)", error)
        return True

    def guard_memory(self, exc: BaseException) -> None:
        """Re-raise a device out-of-memory error as the domain error the runner splits batches on."""
        if is_out_of_memory(exc):
            raise OutOfMemory(f"device out of memory: {exc}") from exc

    def release_memory(self) -> None:
        release_memory(self.device)


class EncoderEngine:
    """What the embedding and classification engines share: one output row per input, a padded forward
    that CUDA graphs can capture per bucket, and the batching plumbing of `EncoderBatching`.

    A subclass sets `_batching`, `_info` and `_cuda_graphs` in its constructor and defines
    `_padded_rows` (padded model inputs to rows on the device, what a graph captures); it overrides
    `_eager_rows` where batches can also run another way (packed)."""

    _batching: EncoderBatching
    _info: EngineInfo
    _cuda_graphs: CudaGraphs
    _graphs: EncoderGraphs | None = None

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def graphs(self) -> EncoderGraphs | None:
        """The captured graphs, when batches replay them."""
        return self._graphs

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self._batching.tokenize(texts)

    def text_spec(self) -> TextSpec:
        return text_spec(self._batching.tokenizer)

    def dummy_input(self, length: int) -> list[int]:
        return self._batching.dummy_input(length)

    def release_memory(self) -> None:
        self._batching.release_memory()

    def cpu_threads(self) -> int:
        return torch.get_num_threads() if self._batching.device.type == "cpu" else 0

    def use_cpu_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is the calling thread's own

    def prepare(
        self, buckets: Sequence[Bucket], capture: Capture | None = None, timer: Timer | None = None
    ) -> None:
        """Capture a CUDA graph per bucket where `model.cuda_graphs` asks for them (see `models.graphs`);
        called once by the loader, before warm-up. `capture` and `timer` stand in for CUDA's in tests."""
        self._graphs = prepare_graphs(
            self._cuda_graphs,
            self._info.packed,
            buckets,
            lambda capture: EncoderGraphs(
                self._padded_rows, self._batching.collate_host, capture, self._batching.device
            ),
            lambda batch: self._padded_rows(self._batching.collate(batch)).float().cpu(),
            self._batching.dummy_input,
            self._batching.device,
            capture,
            timer,
        )

    def forward(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        try:
            with inference(self._batching.device):
                replayed = self._graphs.run(batch) if self._graphs is not None else None
                rows: np.ndarray[Any, Any]
                if replayed is not None:
                    # The replay's rows live in the graph's static outputs: copy them before the next batch.
                    rows = replayed.float().to("cpu", copy=True).numpy()
                else:
                    rows = self._eager_rows(batch).float().cpu().numpy()
        except Exception as exc:
            self._batching.guard_memory(exc)
            raise
        return list(rows)

    def _padded_rows(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded model inputs to one row per input, on the device: what a CUDA graph captures."""
        raise NotImplementedError

    def _eager_rows(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """A batch run without a graph: [inputs, row]."""
        return self._padded_rows(self._batching.collate(batch))
