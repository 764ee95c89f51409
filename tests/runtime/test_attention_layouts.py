"""Generation does not depend on the layout an attention kernel returns its output in.

Each accelerator kernel hands back `scaled_dot_product_attention`'s [batch, heads, length, dim] result in
memory of its own: the math kernel (which CUDA takes for masked grouped-query attention: a prompt chunk
running alone, the warm-up's first step) in that order; flash and memory-efficient attention as
[batch, length, heads, dim]; cuDNN following the query's strides; a kernel that pads the head dimension as a
slice of a wider tensor. On an H100 (2026-11-26 and 11-27) the first two stopped carpool's decoders at
their first step on a `.view` of the output. No CPU kernel returns most of these layouts, so the layouts
are made here from the real kernel's values (the math kernel is also run for real, under `sdpa_kernel`),
and both decoders must give the unpatched run's logits through the real warm-up and through workloads with
a prompt chunk alone, a lone decode and several segments in one step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend
from transformers import LlamaForCausalLM

from carpool.runtime.batching.continuous import BlockAllocator, IterationPolicy, IterationScheduler, Sequence
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import ConfigError, Decoder
from carpool.runtime.engine.generation import GenerationCore
from carpool.runtime.engine.process import load_engine
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.models.device import ATTENTION_BACKENDS_ENV, attention_backends, choose_device
from carpool.runtime.models.generation import GenerationEngine
from tests.runtime.conftest import serve
from tests.runtime.factories import runtime_config
from tests.runtime.layouts import LAYOUTS, layout
from tests.runtime.lora_helpers import tiny_generator
from tests.runtime.steps import record_logits
from tests.runtime.test_lean import engine


def workload(engine: GenerationEngine, prompts: list[int], step_tokens: int) -> list[torch.Tensor]:
    """Prompts of the given lengths through the real scheduler, 4 tokens each: one 16-token prompt runs as
    a prompt chunk alone, then as a lone decode; several make steps of several segments."""
    logits = record_logits(engine)
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=8, max_step_tokens=step_tokens),
        RequestQueue(64, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
    )
    for i, length in enumerate(prompts):
        prompt = [(7 * i + 3 * j) % 30000 + 100 for j in range(length)]
        scheduler.submit(Sequence(tokens=prompt, arrival=0.0, deadline=float("inf"), max_tokens=4), 0.0)
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule(0.0)
        scheduler.complete(plan, engine.step(plan, {}), 0.0)
        for seq in list(scheduler.running):
            if len(seq.output) >= seq.max_tokens:
                scheduler.finish(seq)
    return logits


def warm_up(engine: GenerationEngine) -> list[torch.Tensor]:
    """The engine's real warm-up (1 and 4 sequences of 16 and 40 prompt tokens)."""
    logits = record_logits(engine)
    config = runtime_config(
        model={"source": "tiny", "task": "generate"},
        generation={"max_running_sequences": 8, "kv_cache_tokens": 2048, "max_model_len": 256},
        warmup={"batch_sizes": [1, 4], "sequence_lengths": [16, 40]},
    )
    GenerationCore(engine, config, RuntimeMetrics("tiny"), clock=lambda: 0.0).warm_up()
    return logits


WORKLOADS: dict[str, Callable[[GenerationEngine], list[torch.Tensor]]] = {
    "warm-up": warm_up,
    "lone-prompt-chunk-then-lone-decodes": lambda e: workload(e, [16], 64),
    "several-segments": lambda e: workload(e, [5, 14, 23, 32, 3], 24),
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_generator(tmp_path_factory.mktemp("llama"), seed=3, model=LlamaForCausalLM)


def built(folder: Path, decoder: Decoder, batched: bool) -> GenerationEngine:
    """An engine whose steps attend per sequence or batched (`models.segments`), whichever its load-time
    measurement chose: both ways must hold the layout contract."""
    made = engine(folder, decoder)
    made.attention = dataclasses.replace(made.attention, batched=batched)
    return made


@pytest.fixture(scope="module")
def unpatched(tiny_llama: Path) -> Callable[[str, Decoder, bool], list[torch.Tensor]]:
    """Each workload's logits with the kernel's own layout, computed once per workload, decoder and way."""
    done: dict[tuple[str, Decoder, bool], list[torch.Tensor]] = {}

    def logits(work: str, decoder: Decoder, batched: bool) -> list[torch.Tensor]:
        if (work, decoder, batched) not in done:
            done[work, decoder, batched] = WORKLOADS[work](built(tiny_llama, decoder, batched))
        return done[work, decoder, batched]

    return logits


# carpool's own decoder under every layout; transformers' forward (the same `attend_segments` under its own
# reshapes) under the two layouts CUDA gave it on the H100, to keep the suite's time.
CASES = [
    *((kernel, Decoder.AUTO) for kernel in ["math-kernel", *LAYOUTS]),
    *((kernel, Decoder.TRANSFORMERS) for kernel in ["math-kernel", "flash-transposed"]),
]


@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
@pytest.mark.parametrize("work", list(WORKLOADS))
@pytest.mark.parametrize(("kernel", "decoder"), CASES)
def test_every_kernel_layout_gives_the_same_logits(
    kernel: str,
    work: str,
    decoder: Decoder,
    batched: bool,
    tiny_llama: Path,
    unpatched: Callable[[str, Decoder, bool], list[torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = unpatched(work, decoder, batched)
    with layout(kernel, monkeypatch):
        logits = WORKLOADS[work](built(tiny_llama, decoder, batched))
    assert len(logits) == len(expected) > 0
    for mine, theirs in zip(logits, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_attention_backends_are_read_from_their_variable_and_a_typo_fails_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert attention_backends(None) is None
    assert attention_backends(" ") is None
    assert attention_backends("math, Flash") == [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]
    monkeypatch.setenv(ATTENTION_BACKENDS_ENV, "math,falsh")
    with pytest.raises(ConfigError, match=r"CARPOOL_ATTENTION_BACKENDS.*'falsh'"):
        choose_device("cpu")


LONG = " ".join(f"word{i}" for i in range(150))
"""About 450 tokens of MiniLM's vocabulary: prefilled in chunks, the first of them alone."""


def _answers(folder: Path, decoder: Decoder) -> tuple[str, list[str]]:
    """A lone long prompt's greedy text, then six concurrent prompts' texts, from a served tiny Llama."""
    config = runtime_config(
        model={"source": str(folder), "task": "generate", "dtype": "float32"},
        generation={
            "max_running_sequences": 8,
            "max_step_tokens": 64,
            "kv_cache_tokens": 4096,
            "max_model_len": 512,
            "decoder": decoder.value,
        },
        warmup={"batch_sizes": [1, 8], "sequence_lengths": [16]},
    )
    body = {"temperature": 0, "max_tokens": 8}
    with serve(config, load_engine) as running:
        alone = running.client.post("/v1/completions", json={"prompt": LONG, **body})
        assert alone.status_code == 200, alone.text
        prompts = [{"prompt": f"prompt {i} " * (i + 1), **body} for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda json: running.client.post("/v1/completions", json=json), prompts))
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    return alone.json()["choices"][0]["text"], [r.json()["choices"][0]["text"] for r in replies]


@pytest.mark.slow
@pytest.mark.parametrize("decoder", [Decoder.AUTO, Decoder.TRANSFORMERS])
def test_a_server_with_every_attention_call_on_the_math_kernel_answers_as_without(
    decoder: Decoder, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _answers(tiny_llama, decoder)
    monkeypatch.setenv(ATTENTION_BACKENDS_ENV, "math")
    assert _answers(tiny_llama, decoder) == expected  # the engine's thread reads the variable per step
