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
from carpool.runtime.models.generation import GenerationEngine, adjust_logits
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


# -- penalties, min_tokens, stop tokens (issue 43: what vLLM's sampler applies, on carpool's engine) ------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0)
    adjusted = adjust_logits(logits, prompt=[0], output=[1], params=params, eos_ids={4})
    assert adjusted.tolist() == [1.0, -2.0, 3.0, -2.0, 1.0]  # 0 (prompt) and 1 (output) only
    assert logits.tolist() == [2.0, -1.0, 3.0, -2.0, 1.0]  # the batch's row is left as it was


def test_frequency_counts_each_repeat_and_presence_counts_once_over_the_output_only() -> None:
    logits = torch.zeros(4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    adjusted = adjust_logits(logits, prompt=[3, 3], output=[1, 1, 1, 2], params=params, eos_ids=set())
    assert adjusted.tolist() == pytest.approx([0.0, -1.75, -0.75, 0.0])  # 3 is only in the prompt
    negative = SamplingParams(presence_penalty=-1.0)  # a negative penalty encourages repeats
    assert adjust_logits(logits, [], [2], negative, set()).tolist() == [0.0, 0.0, 1.0, 0.0]


def test_min_tokens_holds_back_end_of_text_and_stop_tokens_until_that_many_are_generated() -> None:
    logits = torch.tensor([0.0, 1.0, 5.0, 4.0])
    params = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    early = adjust_logits(logits, [0], [1], params, eos_ids={2})
    assert early.tolist() == [0.0, 1.0, float("-inf"), float("-inf")]
    assert adjust_logits(logits, [0], [1, 1], params, eos_ids={2}).tolist() == logits.tolist()
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)  # end of text is then an ordinary token
    assert adjust_logits(logits, [0], [], ignoring, eos_ids={2}).tolist() == logits.tolist()


def test_greedy_picks_the_most_likely_token_after_the_penalties() -> None:
    engine: Any = SimpleNamespace(_generators={}, eos_ids={3})
    seqs = [Sequence(tokens=[1], arrival=0.0, deadline=math.inf) for _ in range(3)]
    seqs[0].output, seqs[1].output = [0], [0]
    works = [Work(seq, 0, 1) for seq in seqs]
    logits = torch.tensor([[2.0, 1.9, 0.0, 3.0]] * 3)
    params = {
        seqs[0].seq: SamplingParams(temperature=0.0, min_tokens=5),  # not end of text yet: 0
        seqs[1].seq: SamplingParams(temperature=0.0, min_tokens=5, presence_penalty=0.5),  # 0 said: 1
        seqs[2].seq: SamplingParams(temperature=0.0),  # nothing applies: the row's argmax
    }
    sampled = GenerationEngine._sample(engine, logits, works, params)
    assert [sampled[seq.seq] for seq in seqs] == [0, 1, 3]


def test_a_silent_request_takes_the_models_repetition_penalty_and_a_given_one_wins() -> None:
    """As vLLM's server: the generation config's `repetition_penalty` where the request is silent."""
    from carpool.runtime.api.completions import CompletionRequest
    from carpool.runtime.models.text import sampling_defaults

    defaults = sampling_defaults({"repetition_penalty": 1.3, "temperature": 0.6, "do_sample": True})
    assert defaults == {"repetition_penalty": 1.3, "temperature": 0.6}
    silent = CompletionRequest.model_validate({"prompt": "x"})
    assert silent.sampling(16, defaults)[0].repetition_penalty == 1.3
    said = CompletionRequest.model_validate({"prompt": "x", "repetition_penalty": 1.0})
    assert said.sampling(16, defaults)[0].repetition_penalty == 1.0
    assert silent.sampling(16, {})[0].repetition_penalty == 1.0
