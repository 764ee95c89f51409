"""Per-request sampling settings for text generation (torch-free; they cross the wire to the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy (deterministic)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k filter."""
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    """Log-probabilities to return with each generated token: None, none (nothing is computed or sent);
    N >= 0, the sampled token's and the N most likely tokens' (vLLM's `SamplingParams.logprobs`), of
    the model's raw distribution (before temperature, top-k and top-p, as vLLM's default `raw_logprobs`)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
