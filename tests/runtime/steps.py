"""Driving a `GenerationEngine` step by step through the real iteration scheduler, as the engine's busy loop
does, and keeping what each step handed its sampler (test_lean, test_segments)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from carpool.runtime.batching.continuous import IterationScheduler, Sequence
from carpool.runtime.models.generation import GenerationEngine


def record_logits(engine: GenerationEngine) -> list[torch.Tensor]:
    """A list that every later step's logits are appended to, as the engine hands them to its sampler
    (which still samples)."""
    logits: list[torch.Tensor] = []
    sample = engine._sample

    def keep(rows: torch.Tensor, *args: object) -> dict[int, int]:
        logits.append(rows.clone())
        return sample(rows, *args)  # type: ignore[arg-type]

    engine._sample = keep  # type: ignore[method-assign,assignment]
    return logits


def drive(
    engine: GenerationEngine,
    scheduler: IterationScheduler,
    arrivals: Mapping[int, list[Sequence]] | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Steps until no sequence runs or waits, submitting `arrivals[n]` before step n and finishing a sequence
    at its max_tokens (as the engine does). Returns each step's sampled tokens, and its work as the token
    counts of its sequences ("24", "1,1,3")."""
    tokens: list[list[int]] = []
    kinds: list[str] = []
    pending = dict(arrivals or {})
    while True:
        for seq in pending.pop(len(kinds), []):
            scheduler.submit(seq, 0.0)
        if not (scheduler.running or scheduler.waiting):
            break
        plan = scheduler.schedule(0.0)
        kinds.append(",".join(str(w.count) for w in plan.work))
        out = engine.step(plan, {})
        tokens.append([out[w.seq.seq] for w in plan.work if w.seq.seq in out])
        scheduler.complete(plan, out, 0.0)
        for seq in list(scheduler.running):
            if len(seq.output) >= seq.max_tokens:
                scheduler.finish(seq)
    assert not pending, f"arrivals after every sequence finished: {sorted(pending)}"
    return tokens, kinds
