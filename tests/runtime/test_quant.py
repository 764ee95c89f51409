"""4-bit GGUF blocks and 8-bit weights as torch's packed CPU kernels see them, and the precision choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from carpool.runtime.config import ConfigError, DType, ModelConfig, Task
from carpool.runtime.models import quant
from carpool.runtime.models.device import choose_precision, cpu_bf16_flags


def _gguf_blocks(kind: str, rows: int = 32, inner: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw GGUF blocks of a random weight, quantized by gguf's own code, and gguf's dequantization."""
    weight = np.random.default_rng(seed).standard_normal((rows, inner)).astype(np.float32) * 0.05
    weight[3, :32] += 0.4  # one block with an offset, so that Q4_1's minimum is far from zero
    raw = quants.quantize(weight, GGMLQuantizationType[kind])
    return raw, quants.dequantize(raw, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_4bit_blocks_through_the_int4_kernel_equal_ggufs_own_dequantization(kind: str) -> None:
    """The kernel's `(q - 8) * scale + zero` with the converted codes is the file's weight, element for
    element: read back through `_weight_int4pack_mm_for_cpu` itself (an identity matrix in float32, the
    one place a float32-activation call is made: a test, for exactness)."""
    raw, reference = _gguf_blocks(kind)
    codes = quant.gguf_q4_codes(raw, kind, reference.shape[1])
    assert int(codes.q.min()) >= 0 and int(codes.q.max()) <= 15
    np.testing.assert_array_equal(codes.dequantize().numpy(), reference)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.q, 1)
    scales_zeros = torch.stack([codes.scale.T, codes.zero.T], dim=-1).contiguous()
    eye = torch.eye(reference.shape[1])
    through_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, quant.GROUP, scales_zeros).T
    np.testing.assert_array_equal(through_kernel.numpy(), reference)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_layer_computes_in_bfloat16_close_to_the_dense_weight(kind: str) -> None:
    raw, reference = _gguf_blocks(kind)
    layer = quant.Int4Linear(quant.gguf_q4_codes(raw, kind, reference.shape[1]), None, torch.float32)
    x = torch.randn(5, reference.shape[1])
    out = layer(x)
    assert out.dtype == torch.float32  # the model's dtype back, computed in bfloat16 inside
    expected = x @ torch.from_numpy(reference).T
    assert ((out - expected).norm() / expected.norm()).item() < 0.01
    layer.dense = layer.dequantized()
    layer.dense_for = [True] * len(quant.ROW_BUCKETS)
    dense_out = layer(x)
    assert ((dense_out - expected).norm() / expected.norm()).item() < 0.01


def test_a_broken_scale_shows_in_the_dequantized_weight() -> None:
    """One group's scale off by one step of its float16: the element-for-element comparison catches it."""
    raw, reference = _gguf_blocks("Q4_1")
    broken = raw.copy()
    d = broken[5, 0:2].view(np.float16)
    d[0] = np.nextafter(d[0], np.float16(np.inf))
    codes = quant.gguf_q4_codes(broken, "Q4_1", reference.shape[1])
    assert not np.array_equal(codes.dequantize().numpy(), reference)


def test_int4_and_int8_quantized_at_load_stay_close_to_the_weight() -> None:
    weight = torch.randn(64, 128) * 0.05
    codes = quant.quantize_int4(weight)
    step = codes.scale.repeat_interleave(quant.GROUP, dim=1)
    assert ((codes.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    layer = quant.Int8Linear(weight, None, torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    expected = x.float() @ weight.T
    assert ((layer(x).float() - expected).norm() / expected.norm()).item() < 0.02


def test_kernel_choice_keeps_a_dense_copy_only_where_it_won() -> None:
    raw, _ = _gguf_blocks("Q4_1", rows=64, inner=128)
    layers = [quant.Int4Linear(quant.gguf_q4_codes(raw, "Q4_1", 128), None, torch.bfloat16) for _ in range(2)]
    choice = quant.choose_kernels(layers, buckets=quant.ROW_BUCKETS)
    picks = choice[(64, 128, "int4")]
    assert len(picks) == len(quant.ROW_BUCKETS)
    for layer in layers:
        assert layer.dense_for == picks
        assert (layer.dense is not None) == any(picks)


def test_quantization_mode_follows_checkpoint_dtype_and_device() -> None:
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert quant.resolve_mode("auto", cpu, bf16, gguf=True)[0] == "gguf4"
    assert quant.resolve_mode("auto", cpu, f32, gguf=True)[0] == "none"  # never float32 into int4
    assert quant.resolve_mode("auto", cpu, bf16, gguf=False)[0] == "none"
    assert quant.resolve_mode("int8", cpu, f32, gguf=False)[0] == "int8"
    assert quant.resolve_mode("none", cpu, bf16, gguf=True)[0] == "none"
    cuda, f16 = torch.device("cuda"), torch.float16
    assert quant.resolve_mode("auto", cuda, bf16, gguf=True)[0] == "none"
    with pytest.raises(ConfigError, match="CPU only"):
        quant.resolve_mode("int4", cuda, bf16, gguf=True)
    assert quant.resolve_mode("int8", cuda, bf16, gguf=False)[0] == "int8"
    with pytest.raises(ConfigError, match=r"bfloat16 activations, and model.dtype is float16"):
        quant.resolve_mode("int8", cuda, f16, gguf=False)


def test_fp8_is_served_on_cuda_gpus_of_compute_capability_8_9_and_later() -> None:
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    hopper, ada, ampere = (lambda _: (9, 0)), (lambda _: (8, 9)), (lambda _: (8, 0))
    assert quant.resolve_mode("fp8", cuda, bf16, gguf=False, capability=hopper)[0] == "fp8"
    assert quant.resolve_mode("fp8", cuda, bf16, gguf=True, capability=ada)[0] == "fp8"
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or later .*this GPU has 8.0"):
        quant.resolve_mode("fp8", cuda, bf16, gguf=False, capability=ampere)
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU .* not cpu"):
        quant.resolve_mode("fp8", torch.device("cpu"), bf16, gguf=False)
    with pytest.raises(ConfigError, match=r"model.dtype is float32"):
        quant.resolve_mode("fp8", cuda, torch.float32, gguf=False, capability=hopper)


def test_fp8_layer_stays_close_to_the_weight_and_its_dequantized_form_is_what_it_multiplies() -> None:
    """The same `torch._scaled_mm` call the GPU makes (oneDNN's float8 kernel here): per-channel weight
    scales and per-row activation scales keep the product within float8's precision of the dense one."""
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.05
    weight[5] *= 40  # a channel far larger than the rest: its own scale keeps the others precise
    layer = quant.Fp8Linear(weight, None, torch.bfloat16)
    codes, scale = quant.quantize_fp8(weight)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    dequantized = codes.float() * scale[:, None]
    assert ((dequantized - weight).abs() <= weight.abs() * 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits
    torch.testing.assert_close(layer.dequantized().float(), dequantized, atol=0, rtol=2**-8)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    x[2] *= 100  # a row far larger than the rest: scaled on its own, it loses no more than the others
    got = layer(x).float()
    x32 = x.float()
    x_scale = x32.abs().amax(1, keepdim=True) / quant.FP8_MAX
    fp8_math = ((x32 / x_scale).to(torch.float8_e4m3fn).float() * x_scale) @ dequantized.T
    for row in range(5):  # the kernel computes exactly float8's product (to its bfloat16 output)
        assert ((got[row] - fp8_math[row]).norm() / fp8_math[row].norm()).item() < 0.01
    exact = x32 @ weight.T
    assert ((got - exact).norm() / exact.norm()).item() < 0.05  # and float8's product is close to exact


def test_fp8_quantizes_a_models_body_only() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' stub for Module.to
    report = quant.quantize_model(model, "fp8", None, torch.bfloat16)
    assert report.layers == {"fp8 (at load)": 7} and report.scheme == "fp8"
    assert isinstance(model.model.layers[0].self_attn.q_proj, quant.Fp8Linear)
    assert type(model.lm_head) is torch.nn.Linear


def test_quantization_is_refused_for_encoders() -> None:
    with pytest.raises(ValueError, match="quantization int4 applies to task generate"):
        ModelConfig(task="embed", quantization="int4")  # type: ignore[arg-type]
    assert ModelConfig(task="generate", quantization="int8").quantization.value == "int8"  # type: ignore[arg-type]


def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_it() -> None:
    epyc = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16\n"
    older = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert cpu_bf16_flags(epyc) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(older) == []
    cpu = torch.device("cpu")
    chosen = choose_precision(DType.AUTO, cpu, cpu_bf16_flags(epyc))
    assert chosen.dtype == torch.bfloat16 and "avx512_bf16" in chosen.reason
    assert choose_precision(DType.AUTO, cpu, []).dtype == torch.float32
    generate = choose_precision(DType.AUTO, cpu, cpu_bf16_flags(epyc), task=Task.GENERATE)
    assert generate.dtype == torch.float32 and "generation stays float32" in generate.reason
    assert choose_precision(DType.BFLOAT16, cpu, [], task=Task.GENERATE).dtype == torch.bfloat16
    assert choose_precision(DType.FLOAT32, cpu, cpu_bf16_flags(epyc)).dtype == torch.float32
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        choose_precision(DType.FLOAT16, cpu)
