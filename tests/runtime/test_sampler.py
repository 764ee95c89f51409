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


# -- logit_bias and min_p (issue 43: vLLM's order; greedy follows the bias, never min_p) -----------------


def test_logit_bias_is_added_before_the_repetition_penalty_and_ids_past_the_vocabulary_are_skipped() -> None:
    logits = torch.tensor([2.0, 1.0, 3.0, 0.0])
    params = SamplingParams(repetition_penalty=2.0, logit_bias={1: -3.0, 3: -1.0, 9: 5.0})
    adjusted = adjust_logits(logits, prompt=[1], output=[], params=params, eos_ids=set())
    # 1: (1 - 3) * 2 = -4 (bias first, as vLLM; penalty first would give 1 / 2 - 3 = -2.5); 3: 0 - 1,
    # not seen; 9 is no token of this row (the fronts refuse it before it gets here).
    assert adjusted.tolist() == [2.0, -4.0, 3.0, -1.0]
    assert logits.tolist() == [2.0, 1.0, 3.0, 0.0]


def test_greedy_follows_the_logit_bias() -> None:
    engine: Any = SimpleNamespace(_generators={}, eos_ids=set())
    seqs = [Sequence(tokens=[1], arrival=0.0, deadline=math.inf) for _ in range(3)]
    works = [Work(seq, 0, 1) for seq in seqs]
    logits = torch.tensor([[2.0, 1.9, 0.0, 3.0]] * 3)
    params = {
        seqs[0].seq: SamplingParams(temperature=0.0, logit_bias={0: 1.5}),  # 3.5 beats 3.0
        seqs[1].seq: SamplingParams(temperature=0.0, logit_bias={3: -100.0, 0: -0.2}),  # 1.9 beats 1.8
        seqs[2].seq: SamplingParams(temperature=0.0, min_p=1.0),  # min_p never changes an argmax
    }
    sampled = GenerationEngine._sample(engine, logits, works, params)
    assert [sampled[seq.seq] for seq in seqs] == [0, 1, 3]


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_most_likely() -> None:
    from carpool.runtime.models.generation import min_p_filter

    scores = torch.tensor([2.0, 1.0, 0.0, -1.0])  # each token e (2.72) times less likely than the one before
    inf = float("-inf")
    assert min_p_filter(scores, 0.3).tolist() == [2.0, 1.0, inf, inf]  # 1/e = 0.37 >= 0.3 > 1/e^2
    assert min_p_filter(scores, 0.1).tolist() == [2.0, 1.0, 0.0, inf]  # 1/e^2 = 0.135 >= 0.1 > 1/e^3
    assert min_p_filter(scores, 1.0).tolist() == [2.0, inf, inf, inf]
    assert min_p_filter(scores, 0.0).tolist() == scores.tolist()


def test_min_p_applies_after_temperature() -> None:
    # LOGITS / 2 = [1, 0.5, 0.25, 0]: ratios to the top 0.61, 0.47, 0.37, so min_p 0.4 keeps three
    # (before temperature the ratios are 0.37, 0.22, 0.14: it would keep one).
    warm = shares(SamplingParams(temperature=2.0, min_p=0.4, seed=1))
    expected = torch.softmax(torch.tensor([1.0, 0.5, 0.25]), 0).tolist()  # 0.48, 0.29, 0.23
    assert warm[3] == 0.0
    assert warm[:3] == pytest.approx(expected, abs=0.035)
    # LOGITS / 0.5 = [4, 2, 1, 0]: ratios 0.14, 0.05, 0.02, so min_p 0.1 keeps two (before: all four).
    cold = shares(SamplingParams(temperature=0.5, min_p=0.1, seed=1))
    assert cold[2] == cold[3] == 0.0
    assert cold[0] == pytest.approx(1 / (1 + math.exp(-2)), abs=0.035)


def test_the_openai_fields_clamp_logit_bias_and_bound_min_p_and_n_as_vllm() -> None:
    from pydantic import ValidationError

    from carpool.runtime.api.completions import ChatRequest, CompletionRequest

    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"5": 500, " 7": -0.5, "-3": -250}})
    assert body.sampling(16)[0].logit_bias == {5: 100.0, 7: -0.5, -3: -100.0}  # -3: the front refuses it
    from carpool.runtime.models.text import sampling_defaults

    defaults = sampling_defaults({"min_p": 0.05})  # the model's generation config, where a request is silent
    assert CompletionRequest.model_validate({"prompt": "x"}).sampling(16, defaults)[0].min_p == 0.05
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for field, value in (
        ("logit_bias", {"five": 1}),
        ("logit_bias", {"5": "1"}),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("n", 0),
        ("best_of", 2),  # vLLM's server has no best_of any more: refused by name, as every unknown field
    ):
        for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatRequest, chat)):
            with pytest.raises(ValidationError, match=field):
                model.model_validate({**base, field: value})
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=1.5)
