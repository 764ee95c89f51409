"""What latency the best batcher could reach with this model on this machine: a simulation, no server.

The latency bar (p99 at 70% of saturation under 5x the model's single-request p50) presumes a device on
which a batch costs much less than its inputs one by one. Whether that holds is measurable: fit the
model's cost per batch, `fixed + per_token x tokens`, from timed forward passes, then replay Poisson
arrivals of the corpus's inputs through an ideal batcher: zero overhead (no HTTP, no tokenizer, no thread
hops), and the policy carpool runs with packed batches (whenever a model instance is free, take every
waiting input in arrival order, up to the batch size and token budget). With several model instances
(`model.instances`: two on a CPU) the cost is one instance's while the others run too, and the simulation
runs that many batches at once. Its p99 is a floor for any server that serves requests in arrival order
on this model and machine; `bench.run` prints it beside the measured one.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import percentile


@dataclass(frozen=True)
class CostModel:
    """Seconds one forward pass takes: `fixed_s + per_token_s x tokens`, on one of `instances` model
    instances that run batches at once."""

    fixed_s: float
    per_token_s: float
    instances: int = 1

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]], instances: int = 1) -> CostModel:
        """Least squares over (tokens, seconds) of timed batches (each timed on one of `instances`
        instances running at once); needs two distinct token counts."""
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        if var == 0:
            raise ValueError("the cost model needs batches of at least two different sizes")
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
        return cls(
            fixed_s=max(0.0, mean_y - slope * mean_x), per_token_s=max(0.0, slope), instances=instances
        )


def ideal_latencies(
    lengths: Sequence[int],
    rate: float,
    cost: CostModel,
    max_batch_size: int,
    max_batch_tokens: int,
    requests: int = 20_000,
    seed: int = 0,
) -> list[float]:
    """Latency of each request (after the first tenth, the warm-up) under Poisson arrivals at `rate`
    per second, request i having `lengths[i % len(lengths)]` tokens, through the ideal batcher with
    `cost.instances` model instances."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = []
    now = 0.0
    for i in range(requests):
        now += rng.expovariate(rate)
        arrivals.append((now, lengths[i % len(lengths)]))
    latencies: list[float] = []
    free = [0.0] * max(1, cost.instances)  # when each instance is next free (a heap)
    nxt = 0  # next arrival not yet queued
    queue: list[tuple[float, int]] = []
    while nxt < requests or queue:
        clock = heapq.heappop(free)  # the instance free first takes the next batch
        if not queue:
            clock = max(clock, arrivals[nxt][0])
        while nxt < requests and arrivals[nxt][0] <= clock:
            queue.append(arrivals[nxt])
            nxt += 1
        taken, tokens = 0, 0
        for _, length in queue:
            if taken >= max_batch_size or (taken and tokens + length > max_batch_tokens):
                break
            taken += 1
            tokens += length
        done = clock + cost.seconds(tokens)
        latencies.extend(done - arrived for arrived, _ in queue[:taken])
        del queue[:taken]
        heapq.heappush(free, done)
    return latencies[requests // 10 :]


def ideal_p99(
    lengths: Sequence[int], rate: float, cost: CostModel, max_batch_size: int, max_batch_tokens: int
) -> float:
    return percentile(ideal_latencies(lengths, rate, cost, max_batch_size, max_batch_tokens), 99)
