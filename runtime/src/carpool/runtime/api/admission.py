"""Whether a generation request can ever be served, decided before it is queued. Pure: no clock, no I/O.

A sequence holds its prompt and every token it generates in the KV cache until it finishes, so the
longest it can grow is the smaller of the context (`generation.max_model_len`) and the whole cache
(`num_blocks x block_size` tokens). A request whose prompt plus `max_tokens` (given, or the default
capped to what is left) exceeds that could never finish: it is refused at admission with the numbers,
instead of being queued to stall the scheduler. The front calls `generation_budget` after tokenizing, with
the limits the engine announced in its `TextSpec`, and answers 400 before anything reaches the engine; the
engine's iteration scheduler keeps a backstop (`StepPlan.truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.runtime.errors import InvalidInput


@dataclass(frozen=True)
class ContextLimits:
    """How long one sequence may grow on this server."""

    max_model_len: int
    """The context: prompt plus generated tokens."""
    cache_tokens: int
    """What the whole KV cache holds (num_blocks x block_size)."""

    @property
    def capacity(self) -> int:
        """The most tokens (prompt plus output) one sequence can ever hold."""
        return min(self.max_model_len, self.cache_tokens)

    def describe(self) -> str:
        return (
            f"generation.max_model_len is {self.max_model_len} and the KV cache holds "
            f"{self.cache_tokens} tokens"
        )


def generation_budget(
    prompt_tokens: int, max_tokens: int | None, default_max_tokens: int, limits: ContextLimits
) -> int:
    """The `max_tokens` the sequence runs with; `InvalidInput` (400) if it could never fit.

    An explicit `max_tokens` must fit with the prompt; a defaulted one is capped to the room left, and
    the prompt must leave room for at least one generated token.
    """
    capacity = limits.capacity
    room = capacity - prompt_tokens
    if max_tokens is None:
        if room < 1:
            raise InvalidInput(
                f"the prompt has {prompt_tokens} tokens, leaving no room to generate: a sequence holds "
                f"at most {capacity} tokens ({limits.describe()}); shorten the prompt to at most "
                f"{capacity - 1} tokens"
            )
        return min(default_max_tokens, room)
    if prompt_tokens + max_tokens > capacity:
        advice = (
            f"lower max_tokens to at most {room}"
            if room >= 1
            else f"shorten the prompt to at most {capacity - 1} tokens"
        )
        raise InvalidInput(
            f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: together "
            f"{prompt_tokens + max_tokens}, more than the {capacity} tokens a sequence can hold "
            f"({limits.describe()}); {advice}"
        )
    return max_tokens
