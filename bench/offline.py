"""The offline limit: what the model does on its own, with no server, queue or HTTP in the way.

Two numbers the served figures are judged against:

- `offline_limit`: throughput with perfect batching, every input known up front, sorted by length and cut
  into full batches under the server's own limits (at most `max_batch_size` inputs, and batch size x
  longest input <= `max_batch_tokens`), run on the model instances the server runs (`model.instances`:
  by default two batches at once on a CPU). Model time only: tokenization is done before the clock
  starts, so this is the stricter bound (the server tokenizes in its fronts, in parallel with the model).
- `single_request_latency`: one input at a time, tokenization included: the least latency any server
  can add nothing to.

`python -m bench.offline` prints both for the default model. `--compare-graphs` prints them for each way
an encoder can run its padded batches on CUDA: eager, replayed from CUDA graphs captured by carpool
(`model.cuda_graphs`), and compiled with `torch.compile(mode="reduce-overhead")` (inductor's kernels in its
own CUDA graphs) behind the same buckets, padding and bucket choice, so the two captures are measured
against each other and against eager. Without CUDA it reports eager alone and says why.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/offline.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import percentile
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.engine.instances import InstancePool, instance_pool
from carpool.runtime.models.base import Engine


def load_embedding_engine(config: RuntimeConfig | None = None) -> Engine:
    """The default model as the server loads it (`RuntimeConfig()`): an encoder with `forward`."""
    from carpool.runtime.config import RuntimeConfig
    from carpool.runtime.models.embedding import EmbeddingEngine
    from carpool.runtime.models.loader import load_engine

    engine = load_engine(config or RuntimeConfig())
    if not isinstance(engine, EmbeddingEngine):
        raise SystemExit(f"the benchmark needs an embedding model, the configured one is {engine.info.task}")
    return engine


def length_sorted_batches(
    token_lists: Sequence[list[int]], max_batch_size: int, max_batch_tokens: int
) -> list[list[list[int]]]:
    """Shortest first, each batch as full as the server's limits allow."""
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    for ids in sorted(token_lists, key=len):
        # Sorted ascending, so `ids` is the longest so far: the padded size is count x len(ids).
        if current and (len(current) >= max_batch_size or (len(current) + 1) * len(ids) > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(ids)
    if current:
        batches.append(current)
    return batches


@dataclass
class OfflineResult:
    inputs: int
    seconds: float
    batches: int
    mean_batch_size: float
    padding_ratio: float
    """Share of computed tokens that are padding, over all batches."""

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "seconds": self.seconds,
            "inputs_per_s": self.inputs_per_s,
            "batches": self.batches,
            "mean_batch_size": self.mean_batch_size,
            "padding_ratio": self.padding_ratio,
        }


def run_batches(
    engine: Engine,
    batches: Sequence[Sequence[list[int]]],
    pool: InstancePool,
    timed: list[tuple[Sequence[list[int]], float]] | None = None,
) -> float:
    """Seconds to run `batches` through `engine.forward`, as many at once as `pool` has instances, laid
    out as the server's model instances are: the first in the calling thread (the main thread, where
    torch was initialised), each other one in a thread of its own, each taking the next batch. With
    `timed`, each batch and its own seconds are appended to it as it ends."""
    started = time.perf_counter()
    work = iter(batches)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def instance() -> None:
        while True:
            with lock:
                batch = next(work, None)
            if batch is None or failures:
                return
            try:
                with pool.slot():
                    began = time.perf_counter()
                    engine.forward(batch)
                    if timed is not None:
                        timed.append((batch, time.perf_counter() - began))
            except BaseException as exc:  # re-raised below, in the caller's thread
                failures.append(exc)

    threads = [threading.Thread(target=instance) for _ in range(1, pool.plan.count)]
    for thread in threads:
        thread.start()
    instance()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def offline_limit(
    engine: Engine,
    token_lists: Sequence[list[int]],
    max_batch_size: int,
    max_batch_tokens: int,
    passes: int = 1,
    warmup_batches: int = 3,
    instances: int | None = None,
) -> OfflineResult:
    """Run every input through `engine.forward` in full length-sorted batches, `passes` times, and keep
    the fastest pass (the limit: a slower pass was disturbed by something else on the machine). The
    batches run on the model instances the server runs with `model.instances: instances` (None: its
    default; two at once on a CPU with two or more threads), so the limit is the same model's.

    A few batches of each length band run first, untimed, so allocator growth and first-call costs
    stay out of the figure (the server warms up before it reports ready, too)."""
    batches = length_sorted_batches(token_lists, max_batch_size, max_batch_tokens)
    pool = instance_pool(engine, instances)
    stride = max(1, len(batches) // max(1, warmup_batches))
    run_batches(engine, batches[::stride], pool)
    pass_seconds = [run_batches(engine, batches, pool) for _ in range(passes)]
    real = sum(len(ids) for batch in batches for ids in batch)
    padded = sum(len(batch) * max(len(ids) for ids in batch) for batch in batches)
    return OfflineResult(
        inputs=len(token_lists),
        seconds=min(pass_seconds),
        batches=len(batches),
        mean_batch_size=len(token_lists) / len(batches),
        padding_ratio=1.0 - real / padded if padded else 0.0,
    )


@dataclass
class LatencyResult:
    latencies: list[float]

    def latency(self, q: float) -> float:
        return percentile(self.latencies, q)

    @property
    def p50(self) -> float:
        return self.latency(50)

    @property
    def p99(self) -> float:
        return self.latency(99)

    def summary(self) -> dict[str, Any]:
        return {"samples": len(self.latencies), "p50_ms": self.p50 * 1e3, "p99_ms": self.p99 * 1e3}


def single_request_latency(engine: Engine, texts: Sequence[str], warmup: int = 10) -> LatencyResult:
    """`engine.forward` on one text at a time, tokenization included, for each of `texts` in order."""
    for text in texts[:warmup]:
        engine.forward(engine.tokenize([text]))
    latencies = []
    for text in texts:
        started = time.perf_counter()
        engine.forward(engine.tokenize([text]))
        latencies.append(time.perf_counter() - started)
    return LatencyResult(latencies)


def cost_points(
    engine: Engine,
    token_lists: Sequence[list[int]],
    sizes: Sequence[int] = (1, 4, 16, 32),
    repeats: int = 3,
    pool: InstancePool | None = None,
) -> list[tuple[int, float]]:
    """(tokens computed, seconds) of forward passes over random batches of each size, the model warm:
    what `bench.queueing.CostModel.fit` takes. Tokens computed are the real ones for a packing engine,
    size x longest for a padding one. With `pool` (the server's model instances), the batches of each
    size run on every instance at once, as a loaded server runs them, and each is timed in its own thread:
    the cost of one instance while the others run. Without it, one batch at a time with every thread."""
    pool = pool or instance_pool(engine, 1)
    count = pool.plan.count
    rng = random.Random(0)
    sample = list(token_lists)
    points = []
    for size in sizes:
        timed: list[tuple[Sequence[list[int]], float]] = []
        run_batches(engine, [rng.sample(sample, size) for _ in range((repeats + 1) * count)], pool, timed)
        for batch, seconds in timed[count:]:  # the first to end warmed each instance up to this size
            lengths = [len(ids) for ids in batch]
            tokens = sum(lengths) if engine.info.packed else size * max(lengths)
            points.append((tokens, seconds))
    return points


class CompiledCapture:
    """A `Capture` (see `carpool.runtime.models.graphs`) that compiles the padded forward with
    `torch.compile(mode="reduce-overhead", dynamic=False)` instead of recording it with
    `torch.cuda.graph`: one specialisation per bucket, each replayed from inductor's CUDA graph trees."""

    def __init__(self, buckets: int) -> None:
        import torch._dynamo

        # One recompilation per bucket shape; past the default limit dynamo would fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets + 8)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, buckets + 8)

    def __call__(self, forward: Any, inputs: dict[str, Any]) -> CompiledGraph:
        import torch

        return CompiledGraph(torch.compile(forward, mode="reduce-overhead", dynamic=False), inputs)


class CompiledGraph:
    """A compiled forward over fixed inputs, as a `Graph`: the first calls compile and record, later
    ones replay; its outputs are copied into a buffer of our own, since cudagraph trees reuse theirs."""

    def __init__(self, compiled: Any, inputs: dict[str, Any]) -> None:
        self._compiled = compiled
        self._inputs = inputs
        for _ in range(3):  # compile, record, replay: warm before it is timed
            result = self._call()
        self._outputs = result.clone()

    @property
    def outputs(self) -> Any:
        return self._outputs

    def _call(self) -> Any:
        import torch

        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        return self._compiled(self._inputs)

    def replay(self) -> None:
        self._outputs.copy_(self._call())


@dataclass
class VariantResult:
    name: str
    prepare_seconds: float
    limit: OfflineResult
    single: LatencyResult
    buckets: int

    def line(self) -> str:
        return (
            f"{self.name:>9}: offline limit {self.limit.inputs_per_s:8.1f} inputs/s, single request "
            f"p50 {self.single.p50 * 1e3:6.2f} ms p99 {self.single.p99 * 1e3:6.2f} ms, "
            f"{self.buckets} buckets prepared in {self.prepare_seconds:.1f}s"
        )


def compare_graphs(
    token_lists: Sequence[list[int]],
    sample: Sequence[str],
    max_batch_size: int,
    max_batch_tokens: int,
    cuda: bool,
) -> Iterator[VariantResult]:
    """The offline limit and single-request latency of the default model run eagerly and, on CUDA,
    replayed from carpool's captured graphs and from torch.compile's reduce-overhead mode, over the
    buckets the server would capture for these batching limits; each variant as soon as it is measured
    (compiling every bucket takes minutes on a GPU: a run cut short keeps the variants before it)."""
    from carpool.runtime.config import CudaGraphs
    from carpool.runtime.models.buckets import bucket_grid
    from carpool.runtime.models.embedding import EmbeddingEngine
    from carpool.runtime.warmup import warmup_shapes

    batching = {"max_batch_size": max_batch_size, "max_batch_tokens": max_batch_tokens}
    variants = [("eager", CudaGraphs.OFF)]
    if cuda:
        variants += [("captured", CudaGraphs.ON), ("compiled", CudaGraphs.ON)]
    for name, setting in variants:
        # Warm-up off at load: the loader then captures nothing, and the buckets are prepared here, timed.
        config = RuntimeConfig.model_validate(
            {
                "model": {"cuda_graphs": setting.value},
                "batching": batching,
                "warmup": {"enabled": False},
            }
        )
        engine = load_embedding_engine(config)
        assert isinstance(engine, EmbeddingEngine)
        defaults = RuntimeConfig.model_validate({"batching": batching})
        shapes = warmup_shapes(defaults.warmup, defaults.batching, engine.info.max_input_tokens)
        buckets = bucket_grid(shapes, max_batch_tokens) if setting is CudaGraphs.ON else []
        started = time.perf_counter()
        engine.prepare(buckets, CompiledCapture(len(buckets)) if name == "compiled" else None)
        prepared = time.perf_counter() - started
        limit = offline_limit(engine, token_lists, max_batch_size, max_batch_tokens)
        single = single_request_latency(engine, sample)
        del engine
        yield VariantResult(name, prepared, limit, single, len(buckets))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The model's offline throughput limit and latency.")
    parser.add_argument("--corpus-size", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare-graphs",
        action="store_true",
        help="time eager, carpool's CUDA graphs and torch.compile reduce-overhead (CUDA; eager alone on CPU)",
    )
    parser.add_argument(
        "--instances",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="also measure the offline limit with N model instances (batches at once, model.instances), "
        "each in turn; the first figure is always the server's default",
    )
    parser.add_argument(
        "--background-cores",
        type=float,
        nargs="*",
        default=[],
        metavar="CORES",
        help="also measure the offline limit while another process takes this share of one core (e.g. "
        "0.129: what a server's non-model work takes at a given rate), each in turn",
    )
    args = parser.parse_args(argv)

    from bench.corpus import corpus

    texts = corpus(args.corpus_size, args.seed)
    sample = random.Random(args.seed).sample(texts, min(args.latency_samples, len(texts)))
    if args.compare_graphs:
        import torch

        cuda = torch.cuda.is_available()
        engine = load_embedding_engine()
        token_lists = engine.tokenize(texts)
        del engine
        for result in compare_graphs(token_lists, sample, args.max_batch_size, args.max_batch_tokens, cuda):
            print(result.line(), flush=True)
        if not cuda:
            print("captured, compiled: not run (CUDA graphs need a CUDA device; this machine has none)")
        return 0
    engine = load_embedding_engine()
    token_lists = engine.tokenize(texts)
    limit = offline_limit(engine, token_lists, args.max_batch_size, args.max_batch_tokens, passes=2)
    print(
        f"offline limit: {limit.inputs_per_s:.1f} inputs/s with the default instances "
        f"({instance_pool(engine, None).plan.describe()}; {limit.summary()})"
    )
    for count in args.instances:
        other = offline_limit(
            engine, token_lists, args.max_batch_size, args.max_batch_tokens, passes=2, instances=count
        )
        print(
            f"offline limit with model.instances {count}: {other.inputs_per_s:.1f} inputs/s, "
            f"{other.inputs_per_s / limit.inputs_per_s:.3f}x the default's"
        )
    for cores in args.background_cores:
        with BackgroundLoad(cores):
            shared = offline_limit(engine, token_lists, args.max_batch_size, args.max_batch_tokens, passes=2)
        print(
            f"offline limit with {cores:.3f} cores taken by another process: {shared.inputs_per_s:.1f} "
            f"inputs/s, {shared.inputs_per_s / limit.inputs_per_s:.3f}x the limit"
        )
    single = single_request_latency(engine, sample)
    print(f"single request: p50 {single.p50 * 1e3:.2f} ms, p99 {single.p99 * 1e3:.2f} ms")
    return 0


def _burn(cores: float, period_s: float = 0.002) -> None:
    """Keep one CPU busy `cores` of the time, in slices of `period_s` (a front's requests come as short
    bursts of work between waits, not as one long computation)."""
    busy = period_s * cores
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < busy:
            pass
        time.sleep(period_s - busy)


class BackgroundLoad:
    """Another process taking `cores` (< 1) of the CPU while the block runs: what a server's fronts take
    from the model at a given request rate (`bench.front` measures their CPU per request)."""

    def __init__(self, cores: float) -> None:
        import multiprocessing

        if not 0 < cores < 1:
            raise ValueError("--background-cores takes a share of one core, between 0 and 1")
        self._process = multiprocessing.get_context("spawn").Process(target=_burn, args=(cores,), daemon=True)

    def __enter__(self) -> None:
        self._process.start()
        time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.join()


if __name__ == "__main__":
    sys.exit(main())
