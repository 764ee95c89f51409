"""Per-request sampling settings and finishing rules for text generation (torch-free)."""

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TextTracker:
    """Turns a growing list of token ids into text deltas, holding back what could be the start of a stop
    string or an incomplete character, and tells when a stop string appeared."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.text = ""
        self.stopped = False

    def update(self, text: str) -> str:
        """Give the full decoded output so far; returns the new text safe to send."""
        self.text = text
        for stop in self.stop:
            at = text.find(stop)
            if at != -1:
                self.text = text[:at]
                self.stopped = True
        if self.stopped:
            return self.flush()
        safe = len(text) - self.holdback
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete multi-byte character: wait for the next token
        if safe <= self.sent:
            return ""
        delta = text[self.sent : safe]
        self.sent = safe
        return delta

    def flush(self) -> str:
        """Everything not yet sent (at the end of the sequence)."""
        delta = self.text[self.sent :].rstrip("\ufffd")
        self.sent = len(self.text)
        return delta
