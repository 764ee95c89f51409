"""A generation step's attention (`models.segments`): batched (one call per layer for all decoding sequences,
one for all prompt chunks) against per sequence and against attention written out by hand, and the calls it
makes per step, which must not grow with the number of sequences.

Every workload the engine makes is here: a prompt chunk running alone (the warm-up's first step), a
chunk after cached tokens, a lone decode, several decodes of different lengths (padding), decodes and
chunks in one step, slots that are not contiguous, grouped-query heads; and every output layout an
accelerator kernel may return, since callers `.view` the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from carpool.runtime.batching.continuous import BlockAllocator, IterationPolicy, IterationScheduler, Sequence
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import Decoder, DType, GenerationConfig, ModelConfig, Task
from carpool.runtime.models import segments as seg
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.models.segments import Segment, Segments, attend_segments
from carpool.runtime.sources import resolve_source
from tests.runtime.layouts import LAYOUTS, layout
from tests.runtime.lora_helpers import TINY, tiny_generator
from tests.runtime.steps import drive, record_logits

HEADS, KV_HEADS, DIM, SLOTS = 6, 2, 8, 128


def _segments(spec: list[tuple[int, int, bool]]) -> list[Segment]:
    """Segments laid end to end from (tokens this step, context, contiguous) each; the context's slots sit
    at a sequence's own offset in the pool, in reverse order when not contiguous (as scattered blocks)."""
    out, row = [], 0
    for index, (count, context, contiguous) in enumerate(spec):
        first = 20 * index
        keys: slice | torch.Tensor = slice(first, first + context)
        if not contiguous:
            keys = torch.arange(first + context - 1, first - 1, -1)
        mask = None
        if count > 1:
            past = torch.arange(context - count, context)[:, None]
            mask = torch.arange(context)[None, :] <= past
        out.append(Segment(slice(row, row + count), keys, mask))
        row += count
    return out


WORKLOADS = {
    "a prompt chunk alone": [(16, 16, True)],
    "a chunk after cached tokens": [(5, 12, True)],
    "a lone decode": [(1, 9, True)],
    "decodes of one length": [(1, 7, True), (1, 7, True), (1, 7, True)],
    "decodes of different lengths": [(1, 3, False), (1, 17, True), (1, 9, False), (1, 1, True)],
    "chunks only": [(4, 10, True), (6, 6, True), (2, 19, False)],
    "decodes and chunks mixed": [(1, 3, True), (4, 10, True), (1, 17, False), (6, 6, True), (1, 9, True)],
    "decodes and one chunk": [(1, 5, True), (3, 8, True), (1, 12, True)],
}


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segments: list[Segment]) -> Any:
    """Attention written out by hand in float64: each token over its sequence's slots up to its own."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    per_head = query.shape[1] // keys.shape[1]
    for segment in segments:
        slots = segment.keys
        index = torch.arange(slots.start, slots.stop) if isinstance(slots, slice) else slots
        seq_keys, seq_values = keys[index].double(), values[index].double()
        for t in range(segment.count):
            visible = len(index) - segment.count + t + 1
            for head in range(query.shape[1]):
                q = query[segment.queries.start + t, head].double()
                k, v = seq_keys[:visible, head // per_head], seq_values[:visible, head // per_head]
                weights = torch.softmax(k @ q / math.sqrt(query.shape[2]), dim=0)
                out[segment.queries.start + t, head] = weights @ v
    return out


def _inputs(segments: list[Segment], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(s.count for s in segments)
    # the query as the decoder hands it: a split of q and k rotated together, so not contiguous
    qk = torch.randn((tokens, HEADS + KV_HEADS, DIM), generator=generator)
    query = torch.split(qk, [HEADS, KV_HEADS], dim=1)[0]
    keys = torch.randn((SLOTS, KV_HEADS, DIM), generator=generator)
    values = torch.randn((SLOTS, KV_HEADS, DIM), generator=generator)
    return query, keys, values


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
def test_each_way_equals_attention_written_out(workload: str, batched: bool) -> None:
    segments = _segments(WORKLOADS[workload])
    query, keys, values = _inputs(segments)
    out = attend_segments(query, keys, values, Segments(segments, batched), DIM**-0.5)
    assert out.shape == (query.shape[0], HEADS, DIM) and out.is_contiguous()
    torch.testing.assert_close(out.double(), _reference(query, keys, values, segments), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["math-kernel", *LAYOUTS])
@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
def test_the_result_views_as_tokens_by_hidden_whatever_the_kernels_layout(
    kernel: str, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract callers rely on (lean.py `.view`s it): contiguous [tokens, heads, dim]."""
    for workload in ("a prompt chunk alone", "a lone decode", "decodes and chunks mixed"):
        segments = _segments(WORKLOADS[workload])
        query, keys, values = _inputs(segments, seed=1)
        expected = attend_segments(query, keys, values, Segments(segments, batched), DIM**-0.5)
        with layout(kernel, monkeypatch):
            out = attend_segments(query, keys, values, Segments(segments, batched), DIM**-0.5)
        assert out.is_contiguous(), (kernel, workload)
        torch.testing.assert_close(out.view(query.shape[0], HEADS * DIM), expected.view(-1, HEADS * DIM))


def test_a_step_plan_is_built_once_and_shared_by_every_layer() -> None:
    segments = Segments(_segments(WORKLOADS["decodes and chunks mixed"]), batched=True)
    query, keys, values = _inputs(segments.segments)
    attend_segments(query, keys, values, segments, None)
    plan = segments.plan(query, keys)
    attend_segments(query, keys, values, segments, None)
    assert segments.plan(query, keys) is plan
    assert [type(call).__name__ for call in plan] == ["_Group", "_Group"]


# -- the engine ------------------------------------------------------------------------------------


def _engine(folder: Path, decoder: Decoder, batched: bool) -> GenerationEngine:
    config = ModelConfig(source=str(folder), task=Task.GENERATE, dtype=DType.FLOAT32)
    generation = GenerationConfig(
        kv_cache_tokens=4096, max_model_len=256, kv_block_size=4, decoder=decoder, max_running_sequences=16
    )
    built = GenerationEngine(
        resolve_source(str(folder)), config, generation, "tiny", torch.device("cpu"), torch.float32
    )
    built.attention = seg.Choice(batched, 0.0, 0.0, 16, 256)  # forced: the measured choice may be either
    return built


def _drive(built: GenerationEngine) -> tuple[list[str], list[torch.Tensor]]:
    """A lone 30-token prompt (a 24-token chunk alone, then a 6-token chunk after it), lone decodes, then
    five more prompts of different lengths joining (decodes and chunks mixed, blocks no longer contiguous);
    every step's kinds and logits."""
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=8, max_step_tokens=24),
        RequestQueue(64, 1),
        BlockAllocator(built.num_blocks, built.block_size),
    )

    def prompt(length: int, salt: int) -> Sequence:
        tokens = [(7 * salt + 3 * j) % 30000 + 100 for j in range(length)]
        return Sequence(tokens=tokens, arrival=0.0, deadline=float("inf"), max_tokens=6)

    later = [prompt(length, salt) for salt, length in enumerate((3, 11, 7, 20, 2), start=1)]
    logits = record_logits(built)
    _, kinds = drive(built, scheduler, {0: [prompt(30, 0)], 4: later})
    return kinds, logits


@pytest.mark.parametrize("decoder", [Decoder.AUTO, Decoder.TRANSFORMERS])
def test_batched_steps_equal_per_sequence_steps(decoder: Decoder, tmp_path: Path) -> None:
    """Both decoders, tiny Llama with grouped-query heads (4 heads, 2 key heads)."""
    folder = tiny_generator(tmp_path / "llama", seed=3, model=LlamaForCausalLM)
    assert TINY["num_key_value_heads"] < TINY["num_attention_heads"]
    kinds, expected = _drive(_engine(folder, decoder, batched=False))
    assert kinds[:4] == ["24", "6", "1", "1"]  # a chunk alone, a chunk after cached tokens, lone decodes
    assert any(k.count(",") >= 2 and any(int(n) > 1 for n in k.split(",")) for k in kinds)  # mixed
    batched_kinds, logits = _drive(_engine(folder, decoder, batched=True))
    assert batched_kinds == kinds
    for mine, theirs in zip(logits, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def _calls_per_step(built: GenerationEngine, sequences: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SDPA calls in a decode step and in a mixed step (the same decodes and a newcomer's chunk) of
    `sequences` running sequences."""
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=sequences + 1, max_step_tokens=64),
        RequestQueue(64, 1),
        BlockAllocator(built.num_blocks, built.block_size),
    )
    for i in range(sequences):
        prompt = [100 + (5 * i + j) % 300 for j in range(3 + 2 * i)]  # different lengths: padding
        scheduler.submit(Sequence(tokens=prompt, arrival=0.0, deadline=float("inf"), max_tokens=100), 0.0)
    while any(s.pending > 1 for s in scheduler.running) or scheduler.waiting:
        plan = scheduler.schedule(0.0)
        scheduler.complete(plan, built.step(plan, {}), 0.0)
    calls = 0
    sdpa = F.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return sdpa(*args, **kwargs)

    counts = []
    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", counted)
        for newcomer in (False, True):
            if newcomer:
                newcomer_seq = Sequence(tokens=list(range(200, 212)), arrival=0.0, deadline=float("inf"))
                scheduler.submit(newcomer_seq, 0.0)
            plan = scheduler.schedule(0.0)
            assert len(plan.work) == sequences + newcomer
            calls = 0
            scheduler.complete(plan, built.step(plan, {}), 0.0)
            counts.append(calls)
    return counts


@pytest.mark.parametrize("decoder", [Decoder.AUTO, Decoder.TRANSFORMERS])
def test_attention_calls_per_step_do_not_grow_with_the_sequences(
    decoder: Decoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_generator(tmp_path / "llama", seed=3, model=LlamaForCausalLM)
    layers = TINY["num_hidden_layers"]
    batched = {n: _calls_per_step(_engine(folder, decoder, batched=True), n, monkeypatch) for n in (1, 4, 16)}
    # one call per layer for the decodes; the newcomer's chunk, alone in its group, one more
    assert batched == {n: [layers, 2 * layers] for n in (1, 4, 16)}
    # per sequence (the choice where it measures faster) is one per sequence: what the count tells apart
    per_sequence = _engine(folder, decoder, batched=False)
    assert _calls_per_step(per_sequence, 4, monkeypatch) == [4 * layers, 5 * layers]


def test_the_engine_measures_both_ways_at_load_and_says_which_it_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tiny_generator(tmp_path / "llama", seed=3, model=LlamaForCausalLM)
    config = ModelConfig(source=str(folder), task=Task.GENERATE, dtype=DType.FLOAT32)
    generation = GenerationConfig(kv_cache_tokens=4096, max_model_len=256, kv_block_size=4)
    with caplog.at_level("INFO", logger="carpool.runtime.models.generation"):
        built = GenerationEngine(
            resolve_source(str(folder)), config, generation, "tiny", torch.device("cpu"), torch.float32
        )
    choice = built.attention
    assert choice.sequences == 16 and choice.context == 256
    assert choice.per_sequence_s > 0 and choice.batched_s > 0
    assert choice.batched == (choice.batched_s < choice.per_sequence_s * (1 - seg.MARGIN))
    assert "measured 16 decoding sequences of up to 256 tokens" in caplog.text


def test_batched_is_chosen_where_clearly_faster_and_never_for_one_sequence() -> None:
    keys = torch.zeros((SLOTS, KV_HEADS, DIM))
    # 5% faster is within a loaded machine's noise: per sequence, which copies nothing, stays
    for per_sequence, batched, chosen in ((2.0, 1.0, True), (1.0, 2.0, False), (1.0, 0.95, False)):
        times = iter([per_sequence, batched] * 2)

        def timer(run: Callable[[], Any], device: torch.device) -> float:
            run()
            return next(times)  # noqa: B023

        choice = seg.choose(keys, keys, HEADS, 2, 8, 16, 1.0, timer)
        assert choice.batched == chosen
        assert (choice.sequences, choice.context) == (8, 16)
    alone = seg.choose(keys, keys, HEADS, 2, 1, 16, 1.0, timer)
    assert not alone.batched and "at most one sequence" in alone.describe()
    # no more sequences than the pool holds at that context
    assert seg.choose(keys, keys, HEADS, 2, 64, 64, 1.0, lambda run, device: 1.0).sequences == SLOTS // 64
