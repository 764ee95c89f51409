"""The engine's sampler on fixed logits: temperature, top-k, top-p and seeds each change what is drawn.
These fail if sampling silently became greedy or ignored a setting; seeds keep them deterministic."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from carpool.runtime.batching.continuous import Sequence, Work
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.sampling import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0])
DRAWS = 2000


def draws(params: SamplingParams, count: int = DRAWS, steps: int = 1) -> list[list[int]]:
    """`count` sequences, each with its own seed (params.seed + k) drawing `steps` tokens."""
    engine: Any = SimpleNamespace(_generators={})
    seqs = [Sequence(tokens=[1], arrival=0.0, deadline=math.inf) for _ in range(count)]
    works = [Work(seq, 0, 1) for seq in seqs]
    base = params.seed or 0
    per_seq = {seq.seq: SamplingParams(**{**params.__dict__, "seed": base + k}) for k, seq in enumerate(seqs)}
    logits = LOGITS.expand(count, -1)
    picked: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        sampled = GenerationEngine._sample(engine, logits, works, per_seq)
        for k, seq in enumerate(seqs):
            picked[k].append(sampled[seq.seq])
    return picked


def shares(params: SamplingParams) -> list[float]:
    counts = Counter(d[0] for d in draws(params))
    return [counts[token] / DRAWS for token in range(len(LOGITS))]


def test_temperature_one_draws_from_the_softmax() -> None:
    expected = torch.softmax(LOGITS, 0).tolist()
    observed = shares(SamplingParams(temperature=1.0, seed=1))
    assert observed == pytest.approx(expected, abs=0.035)  # ~4 standard deviations at 2000 draws


def test_a_lower_temperature_sharpens_and_a_higher_one_flattens() -> None:
    cold, warm = (
        shares(SamplingParams(temperature=0.5, seed=1)),
        shares(SamplingParams(temperature=2.0, seed=1)),
    )
    assert cold[0] == pytest.approx(torch.softmax(LOGITS / 0.5, 0)[0].item(), abs=0.035)
    assert warm[0] == pytest.approx(torch.softmax(LOGITS / 2.0, 0)[0].item(), abs=0.035)
    assert cold[0] > 0.8 > warm[0] + 0.3


def test_top_k_keeps_only_the_k_most_likely_tokens_and_samples_among_them() -> None:
    observed = shares(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert observed[2] == observed[3] == 0.0
    assert observed[0] == pytest.approx(math.e / (math.e + 1), abs=0.035)


def test_top_p_keeps_the_smallest_set_over_p_and_samples_among_it() -> None:
    # softmax = [0.58, 0.21, 0.13, 0.08]: 0.7 needs the first two tokens.
    observed = shares(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert observed[2] == observed[3] == 0.0
    assert 0.2 < observed[1] < 0.35


def test_a_seed_fixes_the_draws_and_another_seed_changes_them() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    first, again = draws(params, count=20, steps=8), draws(params, count=20, steps=8)
    other = draws(SamplingParams(temperature=1.0, seed=1000), count=20, steps=8)
    assert first == again
    assert first != other
    assert len({tuple(d) for d in first}) > 10  # not greedy: sequences differ from each other
