"""Padded encoder forwards replayed from captured CUDA graphs: capture, static buffers, pad in, slice out.

A small encoder on a GPU spends most of a forward pass launching kernels (an H100 with MiniLM: a fixed
6.2 ms per batch, a few hundred launches, each waiting on the Python interpreter). A CUDA graph records
those launches once and replays them in one call, on the same buffers. So each bucket of
`models.buckets` gets static input tensors of its shape, captured once; a batch is padded on the host to
its bucket, copied into the bucket's inputs, replayed, and its rows sliced out of the static outputs.

`EncoderGraphs` holds the part that does not depend on CUDA: the buffers, the padding and slicing, the
measuring and the bucket choice. The capture itself is a function passed in (`CudaCapture` on a GPU; the
CPU tests pass one that runs the forward eagerly on the same static buffers), so the same replay path runs
in the CPU tests. Graphs are captured largest first into one memory pool (the first sizes it, the rest
reuse it) as PyTorch's "Graph memory management" notes and vLLM's capture do; a bucket's outputs stay
valid until its next replay, and the engine copies them to the host before the next batch runs.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from carpool.runtime.config import ConfigError, CudaGraphs
from carpool.runtime.models.buckets import FLOOR, Bucket, CostTable, choose_bucket, wants_graphs
from carpool.runtime.models.device import inference

log = logging.getLogger(__name__)

Inputs = dict[str, torch.Tensor]
PaddedForward = Callable[[Inputs], torch.Tensor]
"""Padded model inputs ([rows, length] each) -> one output row per input row, on the device."""
HostCollate = Callable[[Sequence[Sequence[int]], int, int], Inputs]
"""(batch, rows, length) -> the batch padded to exactly [rows, length], on the host."""
Timer = Callable[[Callable[[], object]], float]
"""Seconds one call of a function takes (the model warm)."""


class Graph(Protocol):
    """A captured forward: `replay` recomputes `outputs` from the static inputs it was captured on."""

    @property
    def outputs(self) -> torch.Tensor: ...

    def replay(self) -> None: ...


Capture = Callable[[PaddedForward, Inputs], Graph]
"""Captures `forward` over static inputs that stay allocated as long as the graph."""


class CapturedGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: torch.Tensor) -> None:
        self._graph = graph
        self._outputs = outputs

    @property
    def outputs(self) -> torch.Tensor:
        return self._outputs

    def replay(self) -> None:
        self._graph.replay()


class CudaCapture:
    """Captures with `torch.cuda.graph` into one memory pool shared by all of an engine's graphs.

    Each capture first runs the forward eagerly on a side stream (PyTorch's documented warm-up before
    capture: it settles lazy initialisation, cuBLAS workspaces and kernel choice outside the graph), then
    records it on that stream."""

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def __call__(self, forward: PaddedForward, inputs: Inputs) -> Graph:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                forward(inputs)
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = forward(inputs)
        return CapturedGraph(graph, outputs)


def device_timer(device: torch.device, repeats: int = 3) -> Timer:
    """Best of `repeats` timed calls after an untimed one, the device synchronised around each."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timer(call: Callable[[], object]) -> float:
        call()
        best = math.inf
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            call()
            sync()
            best = min(best, time.perf_counter() - started)
        return best

    return timer


class EncoderGraphs:
    """One captured graph per bucket of a padded encoder, and the choice of graph or eager per batch.

    Call order: `capture(buckets)`, then `measure(timer)` (or `use(table)`), then `run(batch)` per batch.
    `run` answers None for a batch that runs eagerly."""

    def __init__(self, forward: PaddedForward, collate: HostCollate, capture: Capture, device: torch.device):
        self._forward = forward
        self._collate = collate
        self._capture = capture
        self._device = device
        self._inputs: dict[Bucket, Inputs] = {}
        self._graphs: dict[Bucket, Graph] = {}
        self._table = CostTable(graph={}, eager={})
        self._choices: dict[tuple[int, int], Bucket | None] = {}

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._graphs)

    @property
    def table(self) -> CostTable:
        return self._table

    def capture(self, buckets: Sequence[Bucket], dummy: Callable[[int], list[int]]) -> None:
        """Capture a graph for each bucket, in the order given (largest first shares the pool best), on
        static inputs of the bucket's shape. The batch captured on ends one input short of the bucket's
        length, so the warm-up runs before capture take the attention path with a padding mask, the one
        every replay takes."""
        # `torch.cuda.graph` runs a full garbage collection before each capture; with the objects alive now
        # frozen out of its reach (as vLLM's capture does) each of those scans only what capture creates.
        gc.collect()
        gc.freeze()
        try:
            for rows, length in buckets:
                batch = [dummy(length)] * (rows - 1) + [dummy(max(1, length - 1))]
                host = self._collate(batch, rows, length)
                inputs = {name: tensor.to(self._device) for name, tensor in host.items()}
                self._graphs[(rows, length)] = self._capture(self._forward, inputs)
                self._inputs[(rows, length)] = inputs
        finally:
            gc.unfreeze()

    def measure(
        self,
        timer: Timer,
        eager: Callable[[Sequence[Sequence[int]]], object],
        dummy: Callable[[int], list[int]],
    ) -> CostTable:
        """Time each bucket replayed and run eagerly (`eager` is the engine's own padded forward, outputs
        to the host included, as they are after `run`), and the eager `FLOOR`; choose from these times
        from now on."""
        graph: dict[Bucket, float] = {}
        eager_costs: dict[Bucket, float] = {}
        for bucket in self._graphs:
            rows, length = bucket
            batch = [dummy(length)] * rows
            graph[bucket] = timer(self._replayed(batch, bucket))
            eager_costs[bucket] = timer(_bound(eager, batch))
        eager_costs[FLOOR] = timer(_bound(eager, [dummy(FLOOR[1])] * FLOOR[0]))
        self.use(CostTable(graph=graph, eager=eager_costs))
        return self._table

    def _replayed(self, batch: Sequence[Sequence[int]], bucket: Bucket) -> Callable[[], object]:
        return lambda: self.replay(batch, bucket).float().to("cpu", copy=True)

    def use(self, table: CostTable) -> None:
        self._table = table
        self._choices.clear()

    def choose(self, size: int, length: int) -> Bucket | None:
        key = (size, length)
        if key not in self._choices:
            bucket = choose_bucket(self._table, size, length)
            self._choices[key] = bucket if bucket in self._graphs else None
        return self._choices[key]

    def run(self, batch: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """The batch's output rows from its bucket's graph (a view of the graph's static outputs, valid
        until that graph replays again), or None where the batch runs eagerly."""
        bucket = self.choose(len(batch), max(len(ids) for ids in batch))
        return None if bucket is None else self.replay(batch, bucket)

    def replay(self, batch: Sequence[Sequence[int]], bucket: Bucket) -> torch.Tensor:
        """Pad `batch` to `bucket` on the host, copy it into the bucket's static inputs, replay, and
        return the rows of the batch's inputs."""
        static = self._inputs[bucket]
        for name, tensor in self._collate(batch, *bucket).items():
            static[name].copy_(tensor, non_blocking=True)
        graph = self._graphs[bucket]
        graph.replay()
        return graph.outputs[: len(batch)]

    def release(self) -> None:
        """Drop every graph and its buffers (the pool is freed with the last graph); batches run eagerly."""
        self._graphs.clear()
        self._inputs.clear()
        self.use(CostTable(graph={}, eager={}))


def _bound(
    call: Callable[[Sequence[Sequence[int]]], object], batch: Sequence[Sequence[int]]
) -> Callable[[], object]:
    return lambda: call(batch)


def summary(table: CostTable) -> str:
    """One log line: how many buckets replay faster than eager at their own shape, and by how much."""
    faster = [bucket for bucket, cost in table.graph.items() if cost < table.eager.get(bucket, math.inf)]
    if not table.graph:
        return "no buckets"
    ratios = sorted(table.eager[bucket] / table.graph[bucket] for bucket in faster)
    median = f", median speed-up {ratios[len(ratios) // 2]:.1f}x" if ratios else ""
    return f"{len(faster)} of {len(table.graph)} buckets replay faster than eager{median}"


def prepare_graphs(
    setting: CudaGraphs,
    packed: bool,
    buckets: Sequence[Bucket],
    graphs: Callable[[Capture], EncoderGraphs],
    eager: Callable[[Sequence[Sequence[int]]], object],
    dummy: Callable[[int], list[int]],
    device: torch.device,
    capture: Capture | None = None,
    timer: Timer | None = None,
) -> EncoderGraphs | None:
    """An encoder's graphs, captured and measured, or None where its batches run eagerly: `setting` off,
    packed batches, no CUDA (unless a `capture` is passed in: the CPU tests' eager stand-in, or the
    benchmark's torch.compile variant), no buckets, or a capture that failed under `auto`. Under `on` a
    failed capture is a ConfigError: the operator asked for graphs and would not get them."""
    # An injected capture stands in for CUDA's, so the device is judged as if it were a GPU.
    if not wants_graphs(setting, device.type if capture is None else "cuda", packed):
        return None
    if not buckets:
        if setting is CudaGraphs.ON:
            log.warning("cuda graphs: no shapes to capture (warm-up is off); batches run eagerly")
        return None
    started = time.perf_counter()
    runner = graphs(capture or CudaCapture(device))
    try:
        # Inference mode as in `forward`: no autograd state kept alive in the pool by the graphs' outputs.
        with inference(device):
            runner.capture(buckets, dummy)
            table = runner.measure(timer or device_timer(device), eager, dummy)
    except Exception as exc:
        runner.release()
        if setting is CudaGraphs.ON:
            raise ConfigError(
                f"model.cuda_graphs is on but capturing the model failed: {exc}; set it to auto or off"
            ) from exc
        log.warning("cuda graphs: capture failed (%s); batches run eagerly", exc, exc_info=True)
        return None
    log.info(
        "cuda graphs: %d buckets captured in %.1fs; %s",
        len(buckets),
        time.perf_counter() - started,
        summary(table),
    )
    return runner
