"""What the engine process sees of a model backend. torch-free, so the core can type against it.

`EngineInfo` and `TextSpec` live in `wire` (the fronts read them from the engine's status messages)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from carpool.runtime.batching.continuous import StepPlan
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.wire import EngineInfo, TextSpec, TokenLogprobs

__all__ = [
    "AdapterBackend",
    "AnyEngine",
    "CpuThreads",
    "Engine",
    "EngineInfo",
    "GenerativeEngine",
    "TextSpec",
]


class Engine(Protocol):
    """A loaded model. `tokenize` and `forward` are called from worker threads; `forward` runs
    concurrently with itself only with several model instances (`model.instances`, by default only
    for an engine that is also `CpuThreads`); it gets unpadded token ids and returns one output per
    input, in order."""

    @property
    def info(self) -> EngineInfo: ...

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]: ...

    def text_spec(self) -> TextSpec:
        """The tokenizer the fronts use (their ids must equal `tokenize`'s)."""
        ...

    def forward(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]: ...

    def dummy_input(self, length: int) -> list[int]: ...

    def release_memory(self) -> None:
        """Return cached device memory after an out-of-memory error."""
        ...


@runtime_checkable
class CpuThreads(Protocol):
    """An engine whose forward passes run torch on the CPU, safe to run concurrently from several
    threads: `model.instances` divides its intra-op threads between batches (see `engine.instances`)."""

    def cpu_threads(self) -> int:
        """Intra-op threads of a forward pass (0 when the engine does not run on the CPU)."""
        ...

    def use_cpu_threads(self, threads: int) -> None:
        """The calling thread's forward passes use `threads` intra-op threads from now on."""
        ...


class GenerativeEngine(Protocol):
    """A causal language model stepped by the iteration scheduler (see `models.generation`)."""

    eos_ids: set[int]
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def info(self) -> EngineInfo: ...

    def encode(self, prompt: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def text_spec(self) -> TextSpec: ...

    def dummy_prompt(self, length: int) -> list[int]: ...

    logprobs: dict[int, TokenLogprobs]
    """What the last `step` computed for the sequences whose params ask for logprobs (by sequence id);
    read in the model thread right after it."""

    def step(self, plan: StepPlan, params: dict[int, SamplingParams]) -> dict[int, int]: ...

    def forget(self, seq_id: int) -> None: ...

    def release_memory(self) -> None: ...


class AdapterBackend(Protocol):
    """A generative engine's LoRA adapter slots (`models.lora.LoraModel`), its `lora` attribute when
    it serves adapters. Weights are opaque here (host tensors)."""

    def read(self, name: str, source: str) -> Any:
        """Resolve and read an adapter's files, checked against the model; InvalidAdapter says why not.
        Slow (disk, perhaps a download): called in a reader thread, never the busy loop."""
        ...

    def prepare(self, loads: list[tuple[int, Any]], slot_of: dict[int, int]) -> None:
        """Before a step, in the model thread: copy (slot, weights) into the device slots and note the
        slot of each sequence of the step that uses an adapter (by sequence id)."""
        ...


AnyEngine = Engine | GenerativeEngine
