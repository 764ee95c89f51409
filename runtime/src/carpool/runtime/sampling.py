"""Per-request sampling settings for text generation (torch-free; they cross the wire to the engine)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy (deterministic)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k filter."""
    min_p: float = 0.0
    """Keep only the tokens whose probability (after temperature) is at least `min_p` times the most
    likely token's (vLLM's; 0 is none, 1 keeps the most likely only)."""
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    """Log-probabilities to return with each generated token: None, none (nothing is computed or sent);
    N >= 0, the sampled token's and the N most likely tokens' (vLLM's `SamplingParams.logprobs`), of
    the model's raw distribution (before temperature, top-k and top-p, as vLLM's default `raw_logprobs`)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (vLLM's, OpenAI's: -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time the output already holds it (-2..2)."""
    repetition_penalty: float = 1.0
    """For every token in the prompt or the output: a positive logit divided by it, a negative one
    multiplied (vLLM's and transformers'; 1 is none, above 1 discourages repeats)."""
    min_tokens: int = 0
    """Tokens generated before an end-of-text token or a `stop_token_ids` token may be sampled, and before
    `stop` strings are looked for (vLLM's)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the sequence as the end-of-text token does (finish reason `stop`; the token itself
    is not part of the text)."""
    ignore_eos: bool = False
    """Go on past the end-of-text token, to `max_tokens` (vLLM's; for benchmarks)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to these token ids' logits before everything else the sampler does (OpenAI's, vLLM's: the
    fronts clamp each bias to [-100, 100] and refuse ids outside the vocabulary); greedy follows it,
    logprobs stay the raw distribution's."""

    def __post_init__(self) -> None:
        # vLLM's `SamplingParams._verify_args` bounds, named as a request names them.
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def adjusts(self, generated: int) -> bool:
        """Whether a sequence's logits change before sampling once it has `generated` tokens (a bias, a
        penalty, or stop tokens held back for `min_tokens`): what `adjust_logits` does."""
        return bool(self.logit_bias) or self.penalized or generated < self.min_tokens

    def ends_at(self, token: int, eos_ids: Collection[int]) -> bool:
        """Whether `token` ends a sequence with these settings (`stop_ids`, without building the set)."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_ids)

    def stop_ids(self, eos_ids: Collection[int]) -> set[int]:
        """The tokens that end a sequence with these settings: the model's end-of-text tokens (unless
        `ignore_eos`) and `stop_token_ids`."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
