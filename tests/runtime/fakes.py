"""A scripted engine for testing batching mechanics over real HTTP without a model's run time.

It implements the same `Engine` protocol as the transformers engines. Each word is one token; the
"embedding" of a text is [number of tokens, sum of token ids], so every caller can check that it got its
own answer back. `gate` holds forward passes until released, so tests can build a queue on purpose;
texts containing "boom" make their batch raise; `oom_above` makes batches larger than that run out of memory.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.engines.base import EngineInfo
from carpool.runtime.errors import OutOfMemory

BOOM = 999_999


def token_of(word: str) -> int:
    return 100 + zlib.crc32(word.encode()) % 10_000


def expected_embedding(text: str) -> list[float]:
    tokens = [1, *(token_of(w) for w in text.split()), 2]
    return [float(len(tokens)), float(sum(tokens))]


class ScriptedEngine:
    def __init__(self, max_input_tokens: int = 64, oom_above: int | None = None) -> None:
        self._info = EngineInfo(
            name="fake",
            task=Task.EMBED,
            max_input_tokens=max_input_tokens,
            device="cpu",
            dtype="float32",
            source="fake",
            dimensions=2,
        )
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.batches: list[list[list[int]]] = []
        self.oom_above = oom_above
        self.lock = threading.Lock()

    @property
    def info(self) -> EngineInfo:
        return self._info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[1, *(BOOM if w == "boom" else token_of(w) for w in text.split()), 2] for text in texts]

    def dummy_input(self, length: int) -> list[int]:
        return [1] + [5] * max(0, length - 2) + [2]

    def release_memory(self) -> None:
        pass

    def forward(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]:
        self.entered.release()
        self.gate.wait(timeout=30)
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise OutOfMemory("fake device out of memory")
        with self.lock:
            self.batches.append([list(ids) for ids in batch])
        if any(BOOM in ids for ids in batch):
            raise RuntimeError("the model exploded on purpose")
        return [np.array([len(ids), sum(ids)], dtype=np.float32) for ids in batch]

    def served_batches(self) -> list[list[list[int]]]:
        """Batches run after warm-up (warm-up inputs are all 5s)."""
        with self.lock:
            return [b for b in self.batches if not all(set(ids[1:-1]) <= {5} for ids in b)]


def factory(engine: ScriptedEngine) -> Any:
    def build(config: RuntimeConfig) -> ScriptedEngine:
        return engine

    return build
