"""The offline limit: what the model does on its own, with no server, queue or HTTP in the way.

Two numbers the served figures are judged against:

- `offline_limit`: throughput with perfect batching, every input known up front, sorted by length and cut
  into full batches under the server's own limits (at most `max_batch_size` inputs, and batch size x
  longest input <= `max_batch_tokens`). Model time only: tokenization is done before the clock starts,
  so this is the stricter bound (the server tokenizes on another thread, in parallel with the model).
- `single_request_latency`: one input at a time, tokenization included: the least latency any server
  can add nothing to.

`python -m bench.offline` prints both for the default model.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/offline.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import percentile
from carpool.runtime.engines.base import Engine


def load_embedding_engine() -> Engine:
    """The default model as the server loads it (`RuntimeConfig()`): an encoder with `forward`."""
    from carpool.runtime.config import RuntimeConfig
    from carpool.runtime.engines.embedding import EmbeddingEngine
    from carpool.runtime.engines.loader import load_engine

    engine = load_engine(RuntimeConfig())
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


def offline_limit(
    engine: Engine,
    token_lists: Sequence[list[int]],
    max_batch_size: int,
    max_batch_tokens: int,
    passes: int = 1,
    warmup_batches: int = 3,
) -> OfflineResult:
    """Run every input through `engine.forward` in full length-sorted batches, `passes` times, and keep
    the fastest pass (the limit: a slower pass was disturbed by something else on the machine).

    A few batches of each length band run first, untimed, so allocator growth and first-call costs
    stay out of the figure (the server warms up before it reports ready, too)."""
    batches = length_sorted_batches(token_lists, max_batch_size, max_batch_tokens)
    stride = max(1, len(batches) // max(1, warmup_batches))
    for batch in batches[::stride]:
        engine.forward(batch)
    pass_seconds = []
    for _ in range(passes):
        started = time.perf_counter()
        for batch in batches:
            engine.forward(batch)
        pass_seconds.append(time.perf_counter() - started)
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
    engine: Engine, token_lists: Sequence[list[int]], sizes: Sequence[int] = (1, 4, 16, 32), repeats: int = 3
) -> list[tuple[int, float]]:
    """(tokens computed, seconds) of forward passes over random batches of each size, the model warm:
    what `bench.queueing.CostModel.fit` takes. Tokens computed are the real ones for a packing engine,
    size x longest for a padding one."""
    rng = random.Random(0)
    pool = list(token_lists)
    points = []
    for size in sizes:
        engine.forward(rng.sample(pool, size))  # untimed: the first pass of each size warms it up
        for _ in range(repeats):
            batch = rng.sample(pool, size)
            started = time.perf_counter()
            engine.forward(batch)
            seconds = time.perf_counter() - started
            lengths = [len(ids) for ids in batch]
            tokens = sum(lengths) if engine.info.packed else size * max(lengths)
            points.append((tokens, seconds))
    return points


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The model's offline throughput limit and latency.")
    parser.add_argument("--corpus-size", type=int, default=2048)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--latency-samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from bench.corpus import corpus

    texts = corpus(args.corpus_size, args.seed)
    engine = load_embedding_engine()
    limit = offline_limit(engine, engine.tokenize(texts), args.max_batch_size, args.max_batch_tokens)
    sample = random.Random(args.seed).sample(texts, min(args.latency_samples, len(texts)))
    single = single_request_latency(engine, sample)
    print(f"offline limit: {limit.inputs_per_s:.1f} inputs/s ({limit.summary()})")
    print(f"single request: p50 {single.p50 * 1e3:.2f} ms, p99 {single.p99 * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
