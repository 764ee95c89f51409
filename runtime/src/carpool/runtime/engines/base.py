"""What the runtime sees of a model backend. torch-free, so the core can type against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from carpool.runtime.batching.continuous import StepPlan
from carpool.runtime.config import Task
from carpool.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """Facts about a loaded model that the API and the scheduler need."""

    name: str
    task: Task
    max_input_tokens: int
    device: str
    dtype: str
    source: str
    dimensions: int | None = None
    """Embedding width (embed)."""
    labels: list[str] = field(default_factory=list)
    """Class names in output order (classify)."""
    packed: bool = False
    """`forward` lays inputs end to end and computes no padding: a batch costs its real tokens, so the
    batcher needs no length grouping and its token budget counts real tokens."""


class Engine(Protocol):
    """A loaded model. `tokenize` and `forward` are called from worker threads, never concurrently
    with themselves; `forward` gets unpadded token ids and returns one output per input, in order."""

    @property
    def info(self) -> EngineInfo: ...

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]: ...

    def forward(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]: ...

    def dummy_input(self, length: int) -> list[int]: ...

    def release_memory(self) -> None:
        """Return cached device memory after an out-of-memory error."""
        ...


class GenerativeEngine(Protocol):
    """A causal language model stepped by the iteration scheduler (see `engines.generation`)."""

    eos_ids: set[int]
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def info(self) -> EngineInfo: ...

    def encode(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def dummy_prompt(self, length: int) -> list[int]: ...

    def step(self, plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]: ...

    def forget(self, seq_id: int) -> None: ...

    def release_memory(self) -> None: ...


AnyEngine = Engine | GenerativeEngine
